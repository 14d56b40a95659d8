"""The AffinityStore contract: the same tests against the in-memory store and the Redis store.

The memory store keeps time by the ``now`` it is given; Redis by its own clock. The harness moves
both: ``advance`` adds to ``now`` and, for Redis, also sleeps that long (TTLs are short here).

``redis-peer`` writes through one gateway's store and reads through another's, with no
near-cache: what it sees can only come from Redis, not from the writer's local mirror.
``shared-memory-peer`` likewise: one worker's store writes, another attached to the same segment reads.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from extproc.state import AffinityStore, MemoryStore
from extproc.state.factory import open_store
from extproc.state.redis_store import RedisStore
from extproc.state.shared_memory import SharedMemoryStore
from extproc.state.shared_segment import SegmentSize, SharedSegment
from extproc_lab.demo.redis_server import LocalRedis

_namespaces = itertools.count()
TTL_S = 0.4  # short, because Redis expires by the wall clock


@dataclass
class Harness:
    store: AffinityStore
    reader: AffinityStore
    now: float = 100.0
    wall_clock: bool = False

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.wall_clock:
            await asyncio.sleep(seconds)  # real time: the Redis store's TTLs run on Redis's clock

    async def lookup(
        self, session: str | None, hashes: list[int], model: str = "m"
    ) -> tuple[str | None, dict[str, int]]:
        view = await self.reader.lookup(session, hashes, self.now, model=model)
        return view.pinned, dict(view.prefix_matches)

    async def record(
        self, session: str | None, replica: str, hashes: list[int], pin: bool = True, model: str = "m"
    ) -> None:
        await self.store.record(session, replica, hashes, self.now, pin, model=model)
        if isinstance(self.store, RedisStore):
            assert await self.store.flush()


@pytest.fixture(params=["memory", "shared-memory", "shared-memory-peer", "redis", "redis-peer"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    segments: list[SharedSegment] = []
    if request.param == "memory":
        memory = MemoryStore(ttl_s=TTL_S, max_sessions=1000, blocks_per_replica=8)
        h = Harness(memory, memory)
    elif request.param.startswith("shared-memory"):
        created = SharedSegment.create(SegmentSize.for_config(1000, 8, replicas=8, workers=2))
        segments.append(created)
        if request.param == "shared-memory-peer":
            segments.append(SharedSegment.attach(created.name, created.lock))
        writer = SharedMemoryStore(created, ttl_s=TTL_S, blocks_per_replica=8)
        h = Harness(writer, SharedMemoryStore(segments[-1], ttl_s=TTL_S, blocks_per_replica=8))
    else:
        server: LocalRedis = request.getfixturevalue("redis_server")
        namespace = f"contract-{next(_namespaces)}"

        def gateway(near_cache_ttl: float) -> AffinityStore:
            # The contract is what is stored, not how fast: a fresh store's first connection on a
            # busy CI host outlasted the 50 ms default and the store went to its outage mode.
            url = f"{server.url}?near_cache_ttl={near_cache_ttl}&socket_timeout=1&connect_timeout=1"
            return open_store(url, ttl_s=TTL_S, max_sessions=1000, blocks_per_replica=8, namespace=namespace)

        store = gateway(0.1)
        h = Harness(store, gateway(0) if request.param == "redis-peer" else store, wall_clock=True)
    try:
        yield h
    finally:
        await h.store.close()
        await h.reader.close()
        for segment in reversed(segments):
            segment.close()


async def test_a_recorded_decision_is_what_the_next_lookup_sees(harness: Harness) -> None:
    await harness.record("s", "r1", [1, 2, 3])
    assert await harness.lookup("s", [1, 2, 3, 4]) == ("r1", {"r1": 3})


async def test_prefix_matches_are_the_longest_leading_run_per_replica(harness: Harness) -> None:
    await harness.record(None, "a", [1, 2, 3, 4])
    await harness.record(None, "b", [1, 2, 9])
    assert await harness.lookup(None, [1, 2, 3, 4, 5]) == (None, {"a": 4, "b": 2})
    assert await harness.lookup(None, [7, 1, 2]) == (None, {})
    assert await harness.lookup(None, []) == (None, {})


async def test_an_unpinned_record_indexes_the_prefix_but_pins_nothing(harness: Harness) -> None:
    await harness.record("spilled", "r2", [5, 6], pin=False)
    assert await harness.lookup("spilled", [5, 6]) == (None, {"r2": 2})


async def test_a_new_pin_replaces_the_old_one(harness: Harness) -> None:
    await harness.record("s", "r1", [])
    await harness.record("s", "r2", [])
    assert (await harness.lookup("s", []))[0] == "r2"


async def test_sessions_are_kept_per_model(harness: Harness) -> None:
    await harness.record("s", "r1", [], model="llama")
    await harness.record("s", "r2", [], model="qwen")
    assert (await harness.lookup("s", [], model="llama"))[0] == "r1"
    assert (await harness.lookup("s", [], model="qwen"))[0] == "r2"
    assert (await harness.lookup("s", [], model="other"))[0] is None


async def test_a_session_in_use_never_expires_and_an_idle_one_does(harness: Harness) -> None:
    await harness.record("busy", "r1", [])
    await harness.record("idle", "r1", [])
    for _ in range(3):  # 1.5 TTLs in all, each lookup within a TTL of the one before
        await harness.advance(TTL_S / 2)
        assert (await harness.lookup("busy", []))[0] == "r1"
    assert (await harness.lookup("idle", []))[0] is None
    await harness.advance(TTL_S * 1.5)
    assert (await harness.lookup("busy", []))[0] is None


async def test_forgetting_a_replica_drops_its_prefix_entries(harness: Harness) -> None:
    await harness.record(None, "gone", [1, 2, 3])
    await harness.record(None, "kept", [1, 2])
    await harness.store.forget_replica("gone")
    assert await harness.lookup(None, [1, 2, 3]) == (None, {"kept": 2})


async def test_each_replica_keeps_its_most_recent_blocks_up_to_the_bound(harness: Harness) -> None:
    # blocks_per_replica is 8: the third prompt of four blocks pushes the first one out.
    for base in (10, 20, 30):
        await harness.record(None, "r", [base + i for i in range(4)])
    assert await harness.lookup(None, [10, 11, 12, 13]) == (None, {})
    assert await harness.lookup(None, [20, 21, 22, 23]) == (None, {"r": 4})
    assert await harness.lookup(None, [30, 31, 32, 33]) == (None, {"r": 4})


async def test_a_next_turn_extends_what_the_replica_holds(harness: Harness) -> None:
    await harness.record("c", "r", [1, 2, 3])
    await harness.record("c", "r", [1, 2, 3, 4, 5])  # the previous turn resent, then new blocks
    await harness.record("c", "r", [1, 2, 3, 4, 5, 6])
    assert await harness.lookup("c", [1, 2, 3, 4, 5, 6, 7]) == ("r", {"r": 6})
    await harness.record(None, "s", [1, 2, 8])  # another replica learns a branch of the same prefix
    assert await harness.lookup(None, [1, 2, 8, 9]) == (None, {"r": 2, "s": 3})


async def test_peek_sees_the_pin_without_keeping_the_session_alive(harness: Harness) -> None:
    await harness.record("s", "r1", [1, 2, 3])
    await harness.advance(TTL_S * 0.6)
    view = await harness.reader.peek("s", [1, 2, 3], harness.now, model="m")
    assert view.pinned == "r1"
    await harness.advance(TTL_S * 0.6)  # a lookup instead of the peek would have slid the TTL
    assert (await harness.lookup("s", []))[0] is None


async def test_a_forgotten_session_is_routed_as_new(harness: Harness) -> None:
    await harness.record("s", "r1", [])
    assert await harness.store.forget_session("s", model="m")
    assert (await harness.lookup("s", []))[0] is None
    assert not await harness.store.forget_session("never-pinned", model="m")


async def test_cordons_reach_every_reader_until_released(harness: Harness) -> None:
    await harness.store.set_cordon("r1", "cordoned")
    await harness.store.set_cordon("r2", "drained")
    assert await harness.reader.cordons() == {"r1": "cordoned", "r2": "drained"}
    await harness.store.set_cordon("r1", None)
    assert await harness.reader.cordons() == {"r2": "drained"}


async def test_a_replica_capacity_bounds_what_it_is_believed_to_hold(harness: Harness) -> None:
    # r1 reported a cache of 4 blocks; r2 keeps the store's default (8).
    harness.store.set_capacity("r1", 4)
    await harness.record(None, "r1", [1, 2, 3, 4])
    await harness.record(None, "r2", [1, 2, 3, 4])
    await harness.record(None, "r1", [10, 11, 12])
    await harness.record(None, "r2", [10, 11, 12])
    # r1 must have evicted the older prompt's tail (least recently routed first); r2 holds both.
    _, matches = await harness.lookup(None, [1, 2, 3, 4])
    assert matches == {"r1": 1, "r2": 4}
    _, matches = await harness.lookup(None, [10, 11, 12])
    assert matches == {"r1": 3, "r2": 3}


async def remember(harness: Harness, end: int, conversation: int, model: str = "m") -> None:
    await harness.store.remember_conversation(end, conversation, harness.now, model=model)
    if isinstance(harness.store, RedisStore):
        assert await harness.store.flush()


async def test_a_remembered_chain_names_its_conversation_to_every_reader(harness: Harness) -> None:
    big = (1 << 64) - 5  # every bit of a 64-bit identity survives the store (shared memory splits it)
    await remember(harness, 0xABC, big)
    await remember(harness, 0xDEF, 7, model="other")
    assert await harness.reader.conversation(0xABC, harness.now, model="m") == big
    assert await harness.reader.conversation(0xDEF, harness.now, model="m") is None  # another model's
    assert await harness.reader.conversation(0xDEF, harness.now, model="other") == 7
    assert await harness.reader.conversation(0x123, harness.now, model="m") is None
    # A conversation is no session: its chain pins nothing.
    assert (await harness.lookup(f"{0xABC:x}", []))[0] is None


async def test_a_conversation_in_use_never_expires_and_a_peeked_one_does(harness: Harness) -> None:
    await remember(harness, 1, 11)
    await remember(harness, 2, 22)
    for _ in range(3):  # 1.5 TTLs in all
        await harness.advance(TTL_S / 2)
        assert await harness.reader.conversation(1, harness.now, model="m") == 11
        assert await harness.reader.conversation(2, harness.now, model="m", refresh=False) in (22, None)
    assert await harness.reader.conversation(2, harness.now, model="m", refresh=False) is None
    assert await harness.reader.conversation(1, harness.now, model="m") == 11
