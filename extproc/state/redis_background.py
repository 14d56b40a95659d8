"""What a :class:`~extproc.state.redis_store.RedisStore` does off the request path: the writer
that sends the queued writes in batches (one pipeline, or side by side on a Cluster), the prober
that ends an outage episode, and how a failure is counted and starts one (the store's docstring
says why writes wait behind the decision and what an outage changes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.base.world import World
from extproc.state.outage import Outage
from extproc.state.redis_client import UNAVAILABLE, RedisClient, as_awaitable
from extproc.state.redis_keys import KeySpace
from extproc.state.redis_scripts import RECORD, RECORD_SHA, pack_hashes
from extproc.state.store import StoreObserver

log = logging.getLogger("extproc.state")

CONNECT_S = 2.0
"""How long the writer and the prober may take, off the request path, to open a plain client's
first connection or to have a cluster client discover the slots and the command table (a few
round trips and a large ``COMMAND`` reply): the per-operation budget did not always fit either on
a busy machine."""


@dataclass(slots=True)
class StoreCounters:
    """What the store did, for tests and benchmarks (metrics go through the observer)."""

    remote_lookups: int = 0
    near_hits: int = 0
    local_lookups: int = 0
    writes: int = 0
    dropped_writes: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class QueuedWrite:
    """One record (or a conversation's, without blocks) waiting for the writer."""

    model: str
    session: str | None
    replica: str
    hashes: Sequence[int]
    pin: bool


class RedisBackground:
    """The writer and the prober of :class:`~extproc.state.redis_store.RedisStore`, which sets
    every attribute below in its constructor."""

    client: RedisClient
    world: World
    keys: KeySpace
    ttl_ms: int
    prefix_ttl_ms: int
    blocks_per_replica: int
    capacities: dict[str, int]
    op_timeout_s: float
    backlog: int
    batch: int
    outage: Outage
    observer: StoreObserver
    counters: StoreCounters
    _pending: deque[QueuedWrite]
    _unsent: dict[str, tuple[str, int]]
    """key -> the newest pin queued for it and how many of its pin writes are not in Redis yet"""
    _in_flight: int
    _connected: bool
    _wake: asyncio.Event
    _up: asyncio.Event
    _writer: asyncio.Task[None] | None
    _prober: asyncio.Task[None] | None
    _models: set[str]
    _closed: bool

    def _queue(self, write: QueuedWrite) -> None:
        """Queue a write for the background writer (the oldest dropped beyond ``backlog``)."""
        if len(self._pending) >= self.backlog:
            self._settled(self._pending.popleft())
            self.counters.dropped_writes += 1
        self._pending.append(write)
        if write.pin and write.session is not None:
            _, queued = self._unsent.get(write.session, ("", 0))
            self._unsent[write.session] = (write.replica, queued + 1)
        if self.outage.down:  # a backlog piling up is worth seeing; in normal running the writer reports
            self.observer.store_queued(len(self._pending))
        self._wake.set()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="redis-store-writer")

    async def _write_loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and not self.outage.down:
                batch = [self._pending.popleft() for _ in range(min(self.batch, len(self._pending)))]
                self._in_flight = len(batch)
                try:
                    await self._write_batch(batch)
                except UNAVAILABLE as exc:
                    # Back to the front, oldest first; the backlog bound still holds.
                    self._pending.extendleft(reversed(batch))
                    while len(self._pending) > self.backlog:
                        self._settled(self._pending.popleft())
                        self.counters.dropped_writes += 1
                    self._failed("record", exc)
                    continue  # queued again: still on its way
                except Exception as exc:  # a bug must cost this batch, never the writer itself
                    self.counters.dropped_writes += len(batch)
                    self._error("record", exc)
                    log.exception("affinity store write failed")
                finally:
                    self._in_flight = 0
                    self.observer.store_queued(len(self._pending))
                for write in batch:  # in Redis, or lost to a bug: no longer on its way
                    self._settled(write)

    def unsent_pin(self, key: str) -> str | None:
        """The newest pin this gateway queued for ``key`` while some pin write of it has not
        reached Redis yet (the backlog of an outage still draining): what Redis says is older."""
        entry = self._unsent.get(key)
        return entry[0] if entry is not None else None

    def _settled(self, write: QueuedWrite) -> None:
        """``write`` reached Redis, or never will (dropped): one pin write fewer on its way."""
        if not write.pin or write.session is None:
            return
        replica, queued = self._unsent.get(write.session, ("", 0))
        if queued <= 1:
            self._unsent.pop(write.session, None)
        else:
            self._unsent[write.session] = (replica, queued - 1)

    def _record_call(self, w: QueuedWrite, keys: KeySpace) -> tuple[Any, ...]:
        index = keys.prefix_index(w.model, w.replica)
        return (
            3,
            w.session or index,  # any key of the model's slot stands in when there is no session
            keys.replicas(w.model),
            index,
            self.ttl_ms if w.session else 0,
            self.prefix_ttl_ms,
            w.replica,
            self.capacities.get(w.replica, self.blocks_per_replica),
            pack_hashes(w.hashes),
            1 if w.pin else 0,  # unpinned (a spillover), the session was still used: its TTL slides
            self.prefix_ttl_ms // 8,
        )

    async def _discover(self) -> None:
        """Off the request path, before the writer's batches and the prober's pings: a cluster
        client's topology, discovered; a plain client's first connection, opened. Each is
        retried within :data:`CONNECT_S` (a no-op once done): setting up a connection
        (a connect, the handshake, a Sentinel asked for the master) overran the per-operation
        budget on a busy machine, and the first writes then failed. Only timeouts are retried: a
        refused connection or an error reply is an outage like any other, at once."""
        if self._connected:
            return
        deadline = time.monotonic() + CONNECT_S
        while True:
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    if isinstance(self.client, RedisCluster):
                        await self.client.initialize()
                    else:
                        await as_awaitable(self.client.ping())
                self._connected = True
                return
            except (TimeoutError, RedisTimeoutError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)  # real time: a connection being set up over the network

    async def _write_batch(self, batch: list[QueuedWrite]) -> None:
        await self._discover()
        start = time.perf_counter()
        calls = [self._record_call(w, self.keys) for w in batch]
        new_models = {w.model for w in batch} - self._models
        async with asyncio.timeout(self.op_timeout_s + 0.002 * len(batch)):
            if isinstance(self.client, RedisCluster):
                results = await self._write_concurrently(calls, new_models)
            else:
                results = await self._write_pipelined(calls, new_models)
        failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, NoScriptError)]
        unavailable = [r for r in failures if isinstance(r, UNAVAILABLE) and not isinstance(r, ResponseError)]
        if unavailable:
            raise unavailable[0]
        self._models |= new_models
        self.counters.writes += len(batch) - len(failures)
        for failure in failures:  # refused by Redis (out of memory, a foreign key type): not retried
            self._error("record", failure)
        self.observer.store_latency("record", time.perf_counter() - start)

    async def _write_pipelined(self, calls: list[tuple[Any, ...]], new_models: set[str]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(RECORD_SHA, *call)
        for model in new_models:
            pipe.sadd(self.keys.models_key, model)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        missing = [call for call, result in zip(calls, results, strict=False) if isinstance(result, NoScriptError)]
        if missing:  # EVAL loads the script again (a restarted Redis), then EVALSHA works
            pipe = self.client.pipeline(transaction=False)
            for call in missing:
                pipe.eval(RECORD, *call)
            results += await pipe.execute(raise_on_error=False)
        return results

    async def _write_concurrently(self, calls: list[tuple[Any, ...]], new_models: set[str]) -> list[Any]:
        # redis-py refuses scripts in a cluster pipeline: the calls go out side by side instead,
        # each to the node owning its model's slot, which costs about one round trip as well.
        async def one(call: tuple[Any, ...]) -> Any:
            try:
                return await as_awaitable(self.client.evalsha(RECORD_SHA, *call))
            except NoScriptError:
                return await as_awaitable(self.client.eval(RECORD, *call))

        jobs: list[Awaitable[Any]] = [one(call) for call in calls]
        jobs += [as_awaitable(self.client.sadd(self.keys.models_key, model)) for model in new_models]
        return list(await asyncio.gather(*jobs, return_exceptions=True))

    async def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait until every queued write reached Redis; False if that did not happen in time."""
        deadline = time.monotonic() + timeout_s
        while (self._pending or self._in_flight) and not self.outage.down:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.001)  # real time: writes in flight to Redis
        return not self._pending and not self._in_flight

    def _error(self, operation: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self.observer.store_error(operation)
        log.debug("affinity store %s failed: %s: %s", operation, type(exc).__name__, exc)

    def _failed(self, operation: str, exc: BaseException) -> None:
        """An operation failed. A refusal (a ResponseError) concerns that operation only;
        anything else means Redis is unreachable or too slow: an outage episode starts."""
        self._error(operation, exc)
        if isinstance(exc, ResponseError):
            return
        if self.outage.failed(operation, exc):
            self._up.clear()
            self.observer.store_available(False)
            if self._prober is None or self._prober.done():
                self._prober = asyncio.get_running_loop().create_task(self._probe_loop(), name="redis-store-prober")

    async def _probe_loop(self) -> None:
        while self.outage.down and not self._closed:
            await self.world.sleep(self.outage.next_delay())
            try:
                await self._discover()
                async with asyncio.timeout(self.op_timeout_s):
                    await as_awaitable(self.client.ping())
            except UNAVAILABLE as exc:
                self._error("probe", exc)
                continue
            if self.outage.recovered():
                self.observer.store_available(True)
            self._up.set()
            self._wake.set()  # the writer drains what queued up meanwhile
