"""A new prefix goes where the prefix cache has room for it, not where requests lag behind."""

from __future__ import annotations

from typing import Any

from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.registry import SCORES_PROFILE


def test_the_book_fills_a_cache_with_the_uncached_tokens_sent_there() -> None:
    book = ReplicaBook([Replica("r0", "h:0"), Replica("r1", "h:1")])
    book.begin("r0", 0.0, prefill_tokens=1088, kv_tokens=1088)
    fills = {s.name: s.cache_fill for s in book.snapshot(0.0).replicas}
    assert fills == {"r0": 1.0, "r1": 1.0}  # sizes unknown: full, which tells nothing apart
    for name in ("r0", "r1"):
        record = book.record(name)
        assert record is not None
        record.metrics = ReplicaMetrics(block_size=32, num_gpu_blocks=128)
    fills = {s.name: s.cache_fill for s in book.snapshot(0.0).replicas}
    assert fills == {"r0": 1088 / 4096, "r1": 0.0}
    book.hop("r1", 512)  # a prefill hop computes the prompt there, and it stays in that cache
    assert {s.name: s.cache_fill for s in book.snapshot(0.0).replicas} == {"r0": 1088 / 4096, "r1": 512 / 4096}
    book.prefilled("r1", 512)
    for _ in range(4):  # more than the cache holds: full, and it stays so
        book.begin("r0", 1.0, prefill_tokens=1088, kv_tokens=1088)
    assert {s.name: s.cache_fill for s in book.snapshot(1.0).replicas} == {"r0": 1.0, "r1": 512 / 4096}
    # A replica of that name that joins again later is a new engine: its cache starts empty.
    book.leave("r0")
    book.join(Replica("r0", "h:0"))
    record = book.record("r0")
    assert record is not None
    record.metrics = ReplicaMetrics(block_size=32, num_gpu_blocks=128)
    assert {s.name: s.cache_fill for s in book.snapshot(2.0).replicas} == {"r0": 0.0, "r1": 512 / 4096}


def test_an_engine_restarted_under_the_same_name_starts_the_fill_from_its_own_count() -> None:
    book = ReplicaBook([Replica("r0", "h:0")])

    def scrape(queries: float, hits: float) -> float:
        page = ReplicaMetrics(block_size=32, num_gpu_blocks=128, prefix_queries=queries, prefix_hits=hits)
        book.apply_scrape("r0", page, 0.0)
        return book.snapshot(0.0).replicas[0].cache_fill

    assert scrape(5000.0, 1000.0) == 0.0  # a warm engine the router never sent to: not seen (the ledger's limit)
    for _ in range(3):
        book.begin("r0", 1.0, prefill_tokens=1024, kv_tokens=1024)
    assert scrape(8072.0, 1000.0) == 3072 / 4096  # the ledger: what this gateway sent
    # Its lookups went back: a new engine, its cache empty but for what it computed since it started.
    assert scrape(300.0, 0.0) == 300 / 4096
    book.begin("r0", 2.0, prefill_tokens=1024, kv_tokens=1024)
    assert scrape(1324.0, 0.0) == 1324 / 4096  # and the ledger goes on from there


def new_prefix_goes_to(scorer_parameters: dict[str, Any] | None = None) -> str:
    """Where a keyless request of 34 blocks (1,088 tokens) that no replica holds goes with the
    scores profile, three engines of 4,096 tokens: r1 was given the most prefixes (its cache has
    room for 410 tokens, the others' for all of it) but, their requests not back yet, has had the
    fewest recent requests."""
    spec: dict[str, Any] = {**SCORES_PROFILE, "scorers": [dict(s) for s in SCORES_PROFILE["scorers"]]}
    if scorer_parameters is not None:
        for s in spec["scorers"]:
            if s["type"] == "prefill_cost":
                s["parameters"] = scorer_parameters
    features = RequestFeatures(
        path="/v1/completions",
        model="m",
        session_key="k",
        prefix_hashes=tuple(range(34)),
        prompt_chars=34 * 32 * 4,
    )
    replicas = (
        ReplicaState(Replica("r0", "h:0"), recent_requests=6.0, kv_capacity_tokens=4096, cache_fill=0.55),
        ReplicaState(Replica("r1", "h:1"), recent_requests=2.0, kv_capacity_tokens=4096, cache_fill=0.9),
        ReplicaState(Replica("r2", "h:2"), recent_requests=5.0, kv_capacity_tokens=4096, cache_fill=0.27),
    )
    d = decide(DecisionInputs.of(features, Snapshot(replicas), AffinityView(), 0.0, build_profile(spec)))
    assert d.replica is not None
    return d.replica.name


def test_a_new_prefix_goes_to_the_emptiest_cache_not_to_the_replica_with_fewest_recent_requests() -> None:
    assert new_prefix_goes_to() == "r2"
    # Without the displacement, the recent requests decide: the fullest cache takes one more.
    assert new_prefix_goes_to({"evict_weight": 0.0}) == "r1"


def test_where_every_cache_is_full_or_every_cache_has_room_the_fill_tells_nothing_apart() -> None:
    features = RequestFeatures(path="/v1/completions", model="m", prefix_hashes=tuple(range(34)), prompt_chars=4352)
    spec = {**SCORES_PROFILE}
    for capacity, fills in ((4096, (1.0, 1.0, 1.0)), (1_000_000, (0.55, 0.9, 0.27))):
        replicas = tuple(
            ReplicaState(Replica(f"r{i}", f"h:{i}"), recent_requests=r, kv_capacity_tokens=capacity, cache_fill=f)
            for i, (r, f) in enumerate(zip((6.0, 2.0, 5.0), fills, strict=True))
        )
        for weight in (0.0, 1.0, 4.0):
            spec["scorers"] = [
                {**s, "parameters": {"evict_weight": weight}} if s["type"] == "prefill_cost" else s
                for s in SCORES_PROFILE["scorers"]
            ]
            d = decide(DecisionInputs.of(features, Snapshot(replicas), AffinityView(), 0.0, build_profile(spec)))
            assert d.replica is not None and d.replica.name == "r1", (capacity, weight)
