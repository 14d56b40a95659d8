"""/metrics pages as vLLM 0.32 writes them: what is absent stays unknown, and the fake replica's
page has the engine's names and labels (tests/data/vllm_metrics_sample.txt, tests/data/README.md)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from extproc.fleet.health.vllm_metrics import ReplicaMetrics, parse_vllm_metrics
from extproc_lab.replica.engine import ReplicaEngine
from extproc_lab.replica.timing import get_profile
from tests.conftest import ROOT

SAMPLE = (ROOT / "tests" / "data" / "vllm_metrics_sample.txt").read_text()

READ = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:cache_config_info",
)
"""The series the router reads (or must not add twice), as the engine names them."""


def shapes(text: str) -> dict[str, set[tuple[str, ...]]]:
    """Series name -> the label-name sets it appears with."""
    out: dict[str, set[tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).add(tuple(sorted(s.labels)))
    return out


def presence(m: ReplicaMetrics) -> dict[str, bool]:
    """Which fields a page gave (not None, not empty)."""
    return {f.name: getattr(m, f.name) not in (None, (), 0) for f in dataclasses.fields(m) if f.name != "lora"}


def fake_page(**changes: object) -> str:
    engine = ReplicaEngine(dataclasses.replace(get_profile("instant"), **changes))
    return engine.metrics_text("meta-llama/Llama-3.1-8B-Instruct").decode()


def test_a_page_without_prefix_counters_reports_them_unknown_never_zero() -> None:
    lines = SAMPLE.splitlines()
    without = "\n".join(line for line in lines if "prefix_cache_" not in line) + "\n"
    m = parse_vllm_metrics(without)
    assert m.prefix_queries is None and m.prefix_hits is None
    assert m.running == 14  # the rest of the page is read as before
    zeroed = parse_vllm_metrics(SAMPLE.replace("5.812224e+06", "0.0").replace("3.407872e+06", "0.0"))
    assert zeroed.prefix_queries == 0.0 and zeroed.prefix_hits == 0.0  # reported as zero: zero
    sample = parse_vllm_metrics(SAMPLE)
    assert (sample.prefix_queries, sample.prefix_hits) == (5812224.0, 3407872.0)


def test_the_sample_as_vllm_writes_it() -> None:
    m = parse_vllm_metrics(SAMPLE)
    assert m.waiting == 3  # num_requests_waiting_by_reason splits the same 3: not added again
    assert m.preemptions == 12  # the _total series, not its _created timestamp
    assert m.hash_algo == "sha256" and m.block_size == 16
    assert m.models == ("meta-llama/Llama-3.1-8B-Instruct",)
    info = shapes(SAMPLE)["vllm:cache_config_info"]
    assert all("model_name" not in labels and "engine" in labels for labels in info)


def test_the_fake_replicas_page_has_vllms_names_and_labels() -> None:
    fake, sample = shapes(fake_page()), shapes(SAMPLE)
    for name in READ:
        assert fake.get(name) == sample[name], name
    # Every counter the sample has, with its _created series, the fake writes too.
    for name in sample:
        if name.endswith("_total"):
            assert name in fake and name.removesuffix("_total") + "_created" in fake, name


def test_the_fake_replicas_page_parses_as_the_sample_does() -> None:
    page = fake_page(block_size=16, num_gpu_blocks=27545)
    fake, sample = parse_vllm_metrics(page), parse_vllm_metrics(SAMPLE)
    assert (fake.block_size, fake.num_gpu_blocks, fake.hash_algo, fake.models) == (
        sample.block_size,
        sample.num_gpu_blocks,
        sample.hash_algo,
        sample.models,
    )
    # An idle fake reports zero load and zero counters; the fields it gives are the sample's.
    assert fake.prefix_queries == 0.0 and fake.prefix_hits == 0.0  # reported, not absent
    assert fake.itl_sum == 0.0 and fake.itl_count == 0.0
    counters = ("prefix_queries", "prefix_hits", "itl_sum", "itl_count")
    given = {k: v for k, v in presence(sample).items() if k not in ("running", "waiting", "kv_usage", "preemptions")}
    assert {k: presence(fake)[k] or k in counters for k in given} == given


async def test_kv_usage_is_zero_on_an_idle_fake_with_a_full_prefix_cache() -> None:
    engine = ReplicaEngine(dataclasses.replace(get_profile("instant"), num_gpu_blocks=70))
    for word in ("w", "v"):  # two prompts of ~970 tokens: more than the 70 blocks of 16 hold
        await engine.generate(" ".join(f"{word}{i}" for i in range(800)), "m", max_tokens=2)
    assert engine.cache.cached_blocks >= 69 and engine.cache.free_cached_blocks == engine.cache.cached_blocks
    m = parse_vllm_metrics(engine.metrics_text("m").decode())
    assert m.kv_usage == 0.0 and m.running == 0  # as vLLM: the blocks of running requests only
    assert m.prefix_queries is not None and m.prefix_queries > 0
