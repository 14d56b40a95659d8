"""The in-flight prefix table counts each block of each request in flight, whatever path its
add and remove take (the at-once paths for a replica with nothing else in flight, or the
block-by-block count): checked against a plain count over random interleavings."""

from __future__ import annotations

import random
from collections import Counter

from extproc.fleet.cache.inflight import InflightPrefixes


def _counted(requests: list[tuple[str, tuple[int, ...]]]) -> dict[str, dict[int, int]]:
    """What the table must hold for these requests in flight: every block counted per request."""
    out: dict[str, Counter[int]] = {}
    for replica, hashes in requests:
        out.setdefault(replica, Counter()).update(hashes)
    return {r: dict(c) for r, c in out.items() if c}


def test_counts_match_a_plain_count_over_random_interleavings() -> None:
    rng = random.Random(43)
    prompts = [
        tuple(range(1, 41)),  # a long prompt
        tuple(range(1, 11)),  # its first blocks: overlaps it
        (99, 100, 101),  # disjoint
        (7, 7, 8),  # a hash repeated within one prompt (a collision): counted twice
        (),  # no blocks
    ]
    table = InflightPrefixes()
    live: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            replica, hashes = live.pop(rng.randrange(len(live)))
            table.remove(replica, hashes)
        else:
            request = (rng.choice("ab"), rng.choice(prompts))
            table.add(*request)
            live.append(request)
        assert table._per_replica == _counted(live)
        assert len(table) == len(_counted(live))


def test_the_last_request_of_a_replica_takes_its_table_with_it() -> None:
    table = InflightPrefixes()
    table.add("a", (1, 2, 3))
    table.add("a", (1, 2, 3))
    table.remove("a", (1, 2, 3))
    assert table.matches((1, 2, 3)) == {"a": 3}
    table.remove("a", (1, 2, 3))
    assert table.matches((1, 2, 3)) == {} and len(table) == 0
    # A removal after the replica was forgotten changes nothing.
    table.add("b", (5,))
    table.forget(["b"])
    table.remove("b", (5,))
    assert len(table) == 0
