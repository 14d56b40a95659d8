"""The shared-memory tables of ``serve --workers``: racing writers in two processes never raise,
and every read is a value some writer wrote, or a miss."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.health.shared_load import PeerLoad
from extproc.routing.model import Replica
from extproc.state.shared_memory import SharedMemoryStore
from extproc.state.shared_segment import SegmentSize, SharedSegment

REPLICAS = [f"r{i}" for i in range(4)]
SESSIONS = [f"s{i}" for i in range(16)]
CTX = multiprocessing.get_context("spawn")


def hammer(name: str, lock: Any, stop: Any, seed: int) -> None:
    """Write pins and prefixes over the same keys as the test, as fast as possible, until ``stop``."""
    segment = SharedSegment.attach(name, lock)
    store = SharedMemoryStore(segment, ttl_s=60.0, blocks_per_replica=64)
    rng = random.Random(seed)

    async def loop() -> None:
        while not stop.is_set():
            hashes = [rng.randrange(1, 40) for _ in range(rng.randrange(0, 6))]
            await store.record(rng.choice(SESSIONS), rng.choice(REPLICAS), hashes, 1000.0, True, model="m")

    try:
        asyncio.run(loop())
    finally:
        segment.close()


@pytest.fixture(scope="module")
def racing() -> Iterator[SharedSegment]:
    """A small segment (so that slots collide) with another process writing into it throughout."""
    segment = SharedSegment.create(SegmentSize(replicas=8, pin_slots=16, prefix_slots=64, workers=2), CTX.Lock())
    stop = CTX.Event()
    writer = CTX.Process(target=hammer, args=(segment.name, segment.lock, stop, 1))
    writer.start()
    try:
        yield segment
    finally:
        stop.set()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
        segment.close()
    assert writer.exitcode == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(SESSIONS),
            st.sampled_from(REPLICAS),
            st.lists(st.integers(1, 40), max_size=6),
            st.booleans(),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_reads_racing_another_process_are_written_values_or_misses(
    racing: SharedSegment, ops: list[tuple[str, str, list[int], bool]]
) -> None:
    store = SharedMemoryStore(racing, ttl_s=60.0, blocks_per_replica=64)

    async def run() -> None:
        for session, replica, hashes, write in ops:
            if write:
                await store.record(session, replica, hashes, 1000.0, True, model="m")
            view = await store.lookup(session, hashes, 1000.0, model="m")
            assert view.pinned is None or view.pinned in REPLICAS
            assert set(view.prefix_matches) <= set(REPLICAS)
            assert all(1 <= n <= len(hashes) for n in view.prefix_matches.values())

    asyncio.run(run())
    assert store.stats().sessions <= 16


async def test_a_torn_slot_reads_as_a_miss() -> None:
    segment = SharedSegment.create(SegmentSize(replicas=4, pin_slots=16, prefix_slots=16, workers=1))
    try:
        store = SharedMemoryStore(segment, ttl_s=60.0)
        await store.record("s", "r0", [7, 8], 0.0, True)
        assert (await store.lookup("s", [7, 8], 1.0)).prefix_matches == {"r0": 2}
        # Flip one byte of every slot, as a write caught halfway would leave it.
        for at in range(segment.pins_at, len(segment.buf), 32):
            segment.buf[at + 9] ^= 0xFF
        view = await store.lookup("s", [7, 8], 1.0)
        assert view.pinned is None
        assert view.prefix_matches == {}
    finally:
        segment.close()


def test_each_worker_sees_the_load_every_worker_has_in_flight() -> None:
    segment = SharedSegment.create(SegmentSize(replicas=4, pin_slots=16, prefix_slots=16, workers=2))
    try:
        fleet = [Replica("a", "127.0.0.1:1"), Replica("b", "127.0.0.1:2")]
        books = [ReplicaBook(fleet, peers=PeerLoad(segment, w)) for w in range(2)]
        books[0].begin("a", 0.0, prefill_tokens=10, kv_tokens=100)
        books[0].begin("a", 0.0)
        books[1].begin("b", 0.0)
        for book in books:
            states = {s.replica.name: s for s in book.snapshot(0.0).replicas}
            assert (states["a"].inflight, states["b"].inflight) == (2, 1)
            assert states["a"].inflight_tokens == 100
            assert states["a"].pending_prefill_tokens == 10
        books[0].end("a", 0.0, prefill_tokens=10, kv_tokens=100)
        assert {s.replica.name: s.inflight for s in books[1].snapshot(0.0).replicas} == {"a": 1, "b": 1}
        assert books[1].peers is not None and books[1].peers.requests() == [2, 1]
    finally:
        segment.close()


def chained(blocks: list[int]) -> list[int]:
    """Block hashes as the router computes them: each of its whole prefix (a block's hash names
    every block before it), which the store's binary search over a prompt relies on."""
    return [hash(tuple(blocks[: i + 1])) & (2**63 - 1) or 1 for i in range(len(blocks))]


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 12),
    # Few block contents, so that prompts share prefixes of every length.
    contents=st.lists(st.lists(st.integers(1, 3), max_size=10), min_size=1, max_size=12),
)
def test_the_latest_prompt_is_held_up_to_the_capacity(capacity: int, contents: list[list[int]]) -> None:
    # What MemoryStore guarantees too: right after a record, the replica holds that prompt's first
    # min(len, capacity) blocks, whatever was recorded before.
    prompts = [chained(blocks) for blocks in contents]
    segment = SharedSegment.create(SegmentSize(replicas=2, pin_slots=16, prefix_slots=1024, workers=1))
    try:
        store = SharedMemoryStore(segment, ttl_s=60.0, blocks_per_replica=12)
        store.set_capacity("r", capacity)

        async def run() -> None:
            for prompt in prompts:
                await store.record(None, "r", prompt, 0.0, False)
                held = (await store.lookup(None, prompt, 0.0)).prefix_matches.get("r", 0)
                assert held == min(len(prompt), capacity), (prompt, held)

        asyncio.run(run())
    finally:
        segment.close()
