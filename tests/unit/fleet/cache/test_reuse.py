"""Where the hit ratio goes: the ledger of offered, captured and delivered reuse, and its shares."""

from __future__ import annotations

import pytest

from extproc.fleet.cache.reuse import ReuseLedger, shares

LABELS = {"r0": {}, "r1": {}, "p0": {"pool": "premium"}, "p1": {"pool": "premium"}}


def ledger() -> ReuseLedger:
    return ReuseLedger(LABELS.get)


def test_offered_is_the_most_any_replica_of_the_pool_held() -> None:
    book = ledger()
    # 10 blocks; r1 held 8, p0 (another pool) 10: the offer within r0's pool is 8, r0 held 2.
    book.routed("r0", 10, {"r1": 8, "p0": 10, "r0": 2}, 2)
    book.routed("r1", 10, {"r1": 8}, 8)
    book.routed("r1", 0, {"r1": 8}, 0)  # no prefix blocks: nothing to count
    rows = {r.replica: r for r in book.rows(list(LABELS))}
    assert (rows["r0"].prompt_blocks, rows["r0"].offered_blocks, rows["r0"].captured_blocks) == (10, 8, 2)
    assert (rows["r1"].prompt_blocks, rows["r1"].offered_blocks, rows["r1"].captured_blocks) == (10, 8, 8)
    assert rows["p0"].pool == "premium" and rows["r0"].pool == "default"
    assert [r.replica for r in book.rows()] == ["r0", "r1", "p0", "p1"]  # by pool, then name
    s = shares([rows["r0"], rows["r1"]])
    assert s.offered == pytest.approx(16 / 20) and s.captured == pytest.approx(10 / 16)
    assert s.delivered is None and s.engine_hit_ratio is None  # no engine counters read


def test_engine_counters_since_first_read_across_a_restart() -> None:
    book = ledger()
    book.engine_read("r0", None, None)  # an engine without the counters
    book.engine_read("r0", 1000, 5000)  # counted before the router started: not ours
    book.engine_read("r0", 1300, 5600)
    book.engine_read("r0", 50, 100)  # restarted: its counters began again
    book.routed("r0", 100, {"r0": 60}, 60)
    (row,) = [r for r in book.rows() if r.replica == "r0"]
    assert (row.engine_hits_tokens, row.engine_queries_tokens) == (350, 700)
    s = shares([row])
    assert s.engine_hit_ratio == pytest.approx(0.5)
    # The router believed 60% cached; the engine found 50%: it delivered 5/6 of the captured.
    assert s.delivered == pytest.approx(0.5 / 0.6)
    assert [r.engine_queries_tokens for r in book.rows(["r1"]) if r.replica == "r1"] == [-1.0]


def test_replicas_that_left_are_dropped() -> None:
    book = ledger()
    book.routed("r0", 10, {"r0": 5}, 5)
    book.engine_read("r1", 1, 2)
    assert [r.replica for r in book.rows(["r0", "r1"])] == ["r0", "r1"]
    assert [r.replica for r in book.rows(["r1"])] == ["r1"]
    assert [r.replica for r in book.rows()] == ["r1"]
