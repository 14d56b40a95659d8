"""vLLM's own benchmark client (``vllm bench serve``) through real Envoy and our processor to real
vLLM engines: the harness ``extproc bench realstack --workload vllm-bench`` runs, kept working.

The client is vLLM's (its ``prefix_repetition`` dataset on ``/v1/completions``, no session key),
run in the engines' venv by :func:`extproc_lab.bench.realstack.replay_vllm_bench`; what it reports
per request is checked against what the engines counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from extproc_lab.bench.realstack import RealStackSetup, ServeLoad, figures, read_counters, replay_vllm_bench
from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.e2e.conftest import TINY_BLOCKS, TinyEngines

pytestmark = pytest.mark.e2e
_HITS, _QUERIES, _DONE = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_engines: TinyEngines) -> Iterator[LocalGateway]:
    require_binary("envoy")
    gateway = LocalGateway(
        replicas=3, engines=tiny_engines.fresh(), log_dir=tmp_path_factory.mktemp("vllm-bench-client")
    )
    with gateway:
        yield gateway


def test_vllm_bench_serve_runs_through_the_router_and_its_figures_match_the_engines(gw: LocalGateway) -> None:
    setup = RealStackSetup(
        engine="vllm",
        workload="vllm-bench",
        engine_model="tiny",
        kv_blocks=TINY_BLOCKS,
        max_model_len=2048,
        max_tokens=8,
        run_timeout_s=180,
        serve=ServeLoad(num_prompts=16, request_rate=8.0, prefix_len=512, suffix_len=32, num_prefixes=2),
    )
    setup.check()
    before = asyncio.run(read_counters(gw))
    run = replay_vllm_bench(gw.url, setup)
    after = asyncio.run(read_counters(gw))

    assert not run.timed_out
    failed = [t.error for t in run.turns if not t.ok]
    assert not failed, failed
    assert len(run.turns) == 16
    assert all(t.ttft_s > 0 for t in run.turns)
    # Every request the client counted reached an engine, and the shared prefixes were found in cache.
    done = sum(after[n][_DONE] - before[n][_DONE] for n in after)
    assert done == 16
    hits = sum(after[n][_HITS] - before[n][_HITS] for n in after)
    queries = sum(after[n][_QUERIES] - before[n][_QUERIES] for n in after)
    # Two 512-token prefixes over 16 requests of ~544 tokens: at most 6 cold prefills on 3 engines.
    assert hits / queries > 0.5, (hits, queries)

    # Where the client's time to first token went: the engines' own histograms counted each request
    # once, and their time (from the request's arrival at the engine) is inside the client's.
    assert (
        sum(
            after[n]["vllm:time_to_first_token_seconds_count"] - before[n]["vllm:time_to_first_token_seconds_count"]
            for n in after
        )
        == 16
    )
    row = figures(setup, run, before, after)
    assert 0 < row["engine_ttft_mean_s"] < row["ttft_mean_s"], row
    assert 0 <= row["engine_queue_mean_s"] <= row["engine_ttft_mean_s"], row
    assert len(row["ttfts_s"]) == 16
