"""The in-memory affinity store: sliding TTL, bounds, prefix matching."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.state import MemoryStore, PrefixIndex, SessionMap


def test_session_ttl_slides_on_use() -> None:
    m = SessionMap(ttl_s=10, max_sessions=100)
    m.put("s", "r1", now=0)
    assert m.get("s", now=9) == "r1"  # refreshed to expire at 19
    assert m.get("s", now=18) == "r1"
    assert m.get("s", now=28.5) is None  # idle for more than the TTL


def test_session_map_is_bounded_lru() -> None:
    m = SessionMap(ttl_s=100, max_sessions=3)
    for i in range(3):
        m.put(f"s{i}", "r", now=0)
    m.get("s0", now=1)  # s0 becomes most recent
    m.put("s3", "r", now=2)
    assert len(m) == 3
    assert m.get("s1", now=2) is None
    assert m.get("s0", now=2) == "r"


def test_expired_sessions_are_dropped_on_write() -> None:
    m = SessionMap(ttl_s=1, max_sessions=100)
    for i in range(50):
        m.put(f"s{i}", "r", now=0)
    m.put("new", "r", now=5)
    assert len(m) == 1


def test_prefix_matches_are_longest_common_prefix_per_replica() -> None:
    idx = PrefixIndex()
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2, 9])
    assert idx.matches([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.matches([7, 1, 2]) == {}


@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 40), max_size=12)), max_size=60))
def test_prefix_index_stays_within_its_bound(ops: list[tuple[str, list[int]]]) -> None:
    idx = PrefixIndex(blocks_per_replica=10)
    for replica, hashes in ops:
        idx.add(replica, hashes)
    for lru in idx._per_replica.values():
        assert len(lru) <= 10
    owners_total = sum(bin(mask).count("1") for mask in idx._owners.values())
    assert owners_total == sum(len(lru) for lru in idx._per_replica.values())


async def test_memory_store_round_trip() -> None:
    store = MemoryStore(ttl_s=60)
    await store.record("s", "r1", [1, 2, 3], now=0, pin=True)
    view = await store.lookup("s", [1, 2, 3, 4], now=1)
    assert view.pinned == "r1" and view.prefix_matches == {"r1": 3}
    await store.record("t", "r2", [], now=0, pin=False)
    assert (await store.lookup("t", [], now=1)).pinned is None
    await store.forget_replica("r1")
    view = await store.lookup("s", [1, 2, 3], now=2)
    assert view.pinned is None and view.prefix_matches == {}
    assert store.stats().sessions == 0


def test_prefix_index_reuses_the_bit_of_a_replica_that_left() -> None:
    idx = PrefixIndex(blocks_per_replica=100)
    idx.add("a", [1, 2, 3])
    idx.add("b", [1, 2])
    idx.drop_replica("a")
    assert idx.matches([1, 2, 3]) == {"b": 2}
    idx.add("c", [1, 2, 3, 4])  # takes a's bit: nothing of a's may show up as c's
    assert idx.matches([1, 2, 3, 4]) == {"b": 2, "c": 4}
    idx.drop_replica("b")
    idx.drop_replica("c")
    assert len(idx) == 0 and idx.matches([1]) == {}
