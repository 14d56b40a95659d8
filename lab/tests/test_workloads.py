"""Trace loading and workload generation: shapes, determinism, and the features the router sees."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from extproc.api import FeatureSettings, extract_features
from extproc.api import cli_main as main
from extproc.api.sim import block_hashes, model_seed
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.engine import filler_text
from extproc_lab.sim import generators
from extproc_lab.sim.traces import (
    TRACE_FILES,
    TRACES_ENV,
    BlockText,
    azure_workload,
    load_azure,
    load_mooncake,
    load_trace_workload,
    mooncake_workload,
    traces_dir,
)

SETTINGS = FeatureSettings(tenant_header="x-tenant-id")  # the simulator is the gateway: its tenants are trusted
TRACES = Path(__file__).resolve().parents[1] / "extproc_lab" / "sim" / "data" / "traces"


def test_traces_ship_in_the_package_and_are_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TRACES_ENV, raising=False)
    assert traces_dir().resolve() == TRACES.resolve()
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert traces_dir() == tmp_path
    assert traces_dir("/elsewhere") == Path("/elsewhere")


def test_a_missing_trace_says_where_it_was_looked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError) as err:
        WorkloadSpec("mooncake-synthetic", traces=str(tmp_path), limit=10).build()
    message = str(err.value)
    assert str(tmp_path / TRACE_FILES["mooncake-synthetic"]) in message and "--traces-dir" in message
    code = main(["bench", "routing", "--workload", "azure-code", "--traces-dir", str(tmp_path), "--quiet"])
    assert code == 2
    assert str(tmp_path / TRACE_FILES["azure-code"]) in capsys.readouterr().err


def test_mooncake_conversation_trace_loads_with_its_documented_shape() -> None:
    records = load_mooncake(TRACES / TRACE_FILES["mooncake-conversation"], limit=500)
    assert len(records) == 500
    assert all(b.timestamp_ms >= a.timestamp_ms for a, b in itertools.pairwise(records))
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in records)
    wl = mooncake_workload(records, "mooncake-conversation", rate=2.0)
    assert wl.requests[-1].arrival_s == pytest.approx((records[-1].timestamp_ms - records[0].timestamp_ms) / 2000)
    r = wl.requests[1]
    assert r.key_span == 512 and r.keys == records[1].hash_ids[: len(r.keys)]
    assert sum(512 for _ in r.keys[:-1]) + r.tail_span <= r.prompt_tokens


def test_equal_trace_ids_give_equal_text_and_the_router_hashes_of_that_text() -> None:
    text = BlockText()
    a = text.text((1, 2, 3), 1400)
    b = text.text((1, 2, 4), 1400)
    assert len(a) == 1400 * 4
    assert a[:4096] == b[:4096] and a[4096:] != b[4096:]
    for ids, tokens in (((1, 2, 3), 1400), ((1, 2, 4), 1400), ((7,), 100)):
        expected = block_hashes(text.text(ids, tokens), model_seed("demo-model"), 64, 512)
        assert text.hashes(ids, tokens, 512) == expected
    assert text.hashes((1, 2, 3), 1400, 40) == text.hashes((1, 2, 3), 1400, 512)[:40]


def test_trace_keys_cover_full_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    rows = [
        {"timestamp": 0, "input_length": 1030, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1030, "output_length": 5, "hash_ids": [1, 2, 9]},
        {"timestamp": 900, "input_length": 1025, "output_length": 0, "hash_ids": [1, 2, 5]},
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = load_trace_workload(path, rate=1.0)
    first, _, third = wl.requests
    assert (first.keys, first.tail_span) == ((1, 2), 512)  # the last 6 tokens are no full block
    assert third.output_tokens == 1 and [r.arrival_s for r in wl.requests] == [0.0, 0.5, 0.9]


def test_azure_trace_loads_arrivals_and_lengths_with_nothing_shared() -> None:
    records = load_azure(TRACES / TRACE_FILES["azure-conv"], limit=300)
    assert records[0].t_s == 0.0 and all(b.t_s >= a.t_s for a, b in itertools.pairwise(records))
    wl = azure_workload(records, "azure-conv")
    keys = [k for r in wl.requests for k in r.keys]
    assert len(keys) == len(set(keys))
    firsts = {r.features(SETTINGS).prefix_hashes[:1] for r in wl.requests if r.prompt_tokens >= 16}
    assert len(firsts) == sum(1 for r in wl.requests if r.prompt_tokens >= 16)


def test_features_match_what_extract_features_computes() -> None:
    wl = generators.multi_turn(3, seed=1)
    for i, r in enumerate(wl.requests[:5]):
        r.tenant = "acme"
        r.slo_ttft_ms, r.slo_tpot_ms = (250.0, 30.0) if i % 2 else (None, None)
        got = r.features(SETTINGS)
        want = extract_features(r.headers(), json.dumps(r.body()).encode(), SETTINGS)
        assert got == want
    wl2 = generators.unique_prompts(3)
    r = wl2.requests[0]
    assert r.features(SETTINGS) == extract_features(r.headers(), json.dumps(r.body()).encode(), SETTINGS)


def test_multi_turn_resends_the_conversation_with_the_fake_replicas_answers() -> None:
    wl = generators.multi_turn(4, seed=3)
    by_session: dict[str | None, list[int]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r.index)
    for turns in by_session.values():
        assert 6 <= len(turns) <= 9  # 12-18 messages, a user prompt and an answer each
        first, second = wl.requests[turns[0]], wl.requests[turns[1]]
        assert second.after == first.index and first.after == -1
        assert second.messages is not None and first.messages is not None
        assert second.messages[: len(first.messages)] == first.messages
        assert second.messages[len(first.messages)]["content"] == filler_text(first.output_tokens)
        # The follow-up's prompt starts with every block of the previous one.
        assert second.keys[: len(first.keys)] == first.keys
    common = {r.keys[:20] for r in wl.requests}
    assert len(common) == 1  # every prompt starts with the same common prefix


def test_generators_are_deterministic_and_rate_scalable() -> None:
    a = generators.shared_prefix(groups=6, prompts_per_group=3, seed=5)
    b = generators.shared_prefix(groups=6, prompts_per_group=3, seed=5)
    fast = generators.shared_prefix(groups=6, prompts_per_group=3, seed=5, rate=2.0)
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    assert [r.arrival_s for r in fast.requests] == pytest.approx([r.arrival_s / 2 for r in a.requests])
    assert len({r.keys[:50] for r in a.requests}) == 6  # one system prompt per group
    sg = generators.sglang_shared_prefix(groups=4, prompts_per_group=4)
    assert {r.output_tokens for r in sg.requests} == {256}
    assert all(2048 + 128 <= r.prompt_tokens <= 2048 + 200 for r in sg.requests)


def test_tenant_mix_keeps_tenants_apart() -> None:
    wl = WorkloadSpec("tenant-mix", limit=4000).build()
    tenants = {r.tenant for r in wl.requests}
    assert tenants == {"chat", "rag", "batch"}
    keys = {r.features(SETTINGS).session_key for r in wl.requests if r.session}
    assert all(k is not None and k.startswith("chat\x1f") for k in keys)
    assert all(r.after < r.index for r in wl.requests)


def test_nominal_order_puts_follow_ups_after_what_they_follow() -> None:
    wl = generators.multi_turn(5, seed=2)
    seen: set[int] = set()
    for r in wl.nominal_order():
        assert r.after < 0 or r.after in seen
        seen.add(r.index)


def test_agents_grow_pause_fork_and_go_keyless() -> None:
    wl = generators.agents(24, seed=5, fork_share=0.6, keyless_share=0.5)
    again = generators.agents(24, seed=5, fork_share=0.6, keyless_share=0.5)
    assert [r.keys for r in wl.requests] == [r.keys for r in again.requests]  # the seed fixes it
    by_index = {r.index: r for r in wl.requests}
    followers = wl.followers()
    forks = [i for i, after in followers.items() if len(after) > 1]
    assert wl.info["forks"] == len(forks) > 0
    for parent in forks:
        a, b = (by_index[i] for i in followers[parent])
        # Both the parent's next turn and the sub-agent's first share the parent's whole context.
        shared = by_index[parent].keys
        assert a.keys[: len(shared) - 1] == b.keys[: len(shared) - 1] == shared[:-1]
        assert a.session != b.session or a.session is None
    keyless = [r for r in wl.requests if r.session is None]
    assert 0 < len(keyless) < len(wl.requests)
    feats = keyless[0].features(SETTINGS)
    assert feats.session_key is None and feats.conversation is not None  # known by its messages
    for r in wl.requests:
        if r.after >= 0 and r.session is not None and by_index[r.after].session == r.session:
            assert r.prompt_tokens > by_index[r.after].prompt_tokens  # a growing context
    pauses = [r.arrival_s for r in wl.requests if r.after >= 0 and r.arrival_s > 0]
    assert 1.0 < sum(pauses) / len(pauses) < 3.0  # tool pauses of seconds (2 s mean)
    assert {r.messages[0]["content"] for r in wl.requests if r.messages} == {wl.requests[0].messages[0]["content"]}
