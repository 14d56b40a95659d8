"""The affinity store in Redis, shared by every gateway of a deployment (active-active).

Several gateway pods each see only some turns of a conversation; with state in process memory a
session whose turns land on different pods is scattered again. Here every pod reads and writes
the same session pins and the same approximate prefix index.

**One round trip per lookup.** A lookup is one ``EVALSHA`` of a Lua script that reads the
session's pin and refreshes its TTL (``GETEX ... PX``: the TTL slides in the same round trip
as the read) and runs the longest-prefix search inside Redis: for each replica, a binary search
over the prompt's chained block hashes (see :mod:`extproc.state.redis_scripts` for why a script
and not a pipeline). The reply is the pin plus a few ``(replica, blocks)`` pairs.

**Near-cache.** A pin learned in the last ``near_cache_ttl_s`` (1 s) answers without Redis (an
agent's burst of calls in one session); prefix matches then come from the local mirror. This
bounds how long a gateway can follow a pin another gateway has just moved.

**Writes behind the decision.** ``record`` updates the local mirror and the near-cache at once
and queues the Redis write; a background writer (:mod:`extproc.state.redis_background`, with the
prober below) sends what is queued in one pipeline per batch.
The decision never waits for a write, and this gateway reads its own: while a pin write of a
session is queued, its lookups answer the newest pin queued, not what Redis still holds (an
outage's backlog may take a while to drain). The price: another gateway may not see a pin for one
round trip after the answer went to Envoy (a conversation's next turn comes after the reply, far
later), and writes queued when the process dies are lost. The queue is bounded (``backlog``):
when Redis is away the oldest writes are dropped first and the rest are sent when it returns.

**Redis going away.** Every call has a short timeout (socket and connect timeouts of 50 ms
by default, far below Envoy's message timeout). The first failure starts an outage episode
(logged once, counted on every failure): lookups are then answered from the local mirror,
a :class:`~extproc.state.memory.MemoryStore` that sees every decision of this gateway and
every pin it read from Redis, without touching the network, so no request waits on a dead Redis;
a prober pings with exponential backoff and, once Redis answers, lookups go remote again and
the writer drains its backlog. The store never raises into the router.

Timeouts are wall-clock: an event loop kept busy for longer than the timeout by other work
looks like a slow Redis, and the store falls back to local state for that episode, which is
the right thing for a gateway that saturated.

**Memory** (``benchmarks/store_latency.py``, results in ``benchmarks/store_latency.md``): about
190 bytes of Redis memory per session (a 36-character session id: key, replica name, expiry
entry), so 180 MiB for a million sessions; about 110 bytes per prefix-index entry (one block
on one replica, a sorted-set member), 13 MiB for 31,250 blocks on each of 4 replicas. Entries
expire after ``prefix_ttl_s`` and each replica keeps at most ``blocks_per_replica``.
``max_sessions`` bounds only the local mirror: bound Redis with ``maxmemory`` and
``volatile-lru`` (every key here has a TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from extproc.base.world import REAL_WORLD, World
from extproc.routing.model import AffinityView
from extproc.state.memory import MemoryStore
from extproc.state.near_cache import NearCache
from extproc.state.outage import Outage
from extproc.state.redis_background import QueuedWrite, RedisBackground, StoreCounters
from extproc.state.redis_client import DEFAULT_TIMEOUT_S, UNAVAILABLE, RedisClient, as_awaitable
from extproc.state.redis_keys import KeySpace
from extproc.state.redis_scripts import LOOKUP, LOOKUP_SHA, pack_hashes, parse_lookup
from extproc.state.store import NullStoreObserver, StoreObserver, StoreStats


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStore(RedisBackground):
    """:class:`~extproc.state.store.AffinityStore` on Redis with a near-cache and a local mirror."""

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str = "default",
        ttl_s: float = 600.0,
        max_sessions: int = 100_000,
        blocks_per_replica: int = 31_250,
        prefix_ttl_s: float | None = None,
        near_cache_ttl_s: float = 1.0,
        near_cache_size: int = 10_000,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backlog: int = 10_000,
        batch: int = 64,
        reconnect_base_s: float = 0.05,
        reconnect_max_s: float = 1.0,
        observer: StoreObserver | None = None,
        name: str = "redis",
        world: World = REAL_WORLD,
    ) -> None:
        self.client = client
        self.world = world  # the outage's probes wait on its time
        self.keys = KeySpace(namespace)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.prefix_ttl_ms = max(1, round((prefix_ttl_s or ttl_s) * 1000))
        self.blocks_per_replica = blocks_per_replica
        self.capacities: dict[str, int] = {}
        self.local = MemoryStore(ttl_s, max_sessions, blocks_per_replica)
        self.near = NearCache(min(near_cache_ttl_s, ttl_s), near_cache_size)
        # Whole-operation bound on top of the socket timeouts (a connect plus a read, or a
        # Sentinel asking for the master first): still a small fraction of Envoy's timeout.
        self.op_timeout_s = max(2 * timeout_s, 0.01)
        self.backlog = backlog
        self.batch = batch
        self.outage = Outage(name, reconnect_base_s, reconnect_max_s)
        self.observer: StoreObserver = observer or NullStoreObserver()
        self.counters = StoreCounters()
        self._pending: deque[QueuedWrite] = deque()
        self._unsent: dict[str, tuple[str, int]] = {}
        self._in_flight = 0
        self._connected = False  # the first connection opened (a cluster's topology discovered)
        self._wake = asyncio.Event()
        self._up = asyncio.Event()
        self._up.set()
        self._writer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._models: set[str] = set()
        self._closed = False

    @property
    def available(self) -> bool:
        """Whether Redis is in use (False during an outage episode)."""
        return not self.outage.down

    async def wait_available(self, timeout_s: float) -> bool:
        """Wait until Redis is in use again (after an outage); False if not within ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._up.wait()
        return self.available

    async def lookup(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """The session's pin and the prefix holders: near-cache, else Redis, else the local mirror."""
        local = await self.local.lookup(session_key, prefix_hashes, now, model=model)
        skey = self.keys.session(model, session_key) if session_key else None
        if skey is not None:
            cached = self.near.get(skey, now)
            if cached is not None:
                self.counters.near_hits += 1
                return AffinityView(pinned=cached, prefix_matches=local.prefix_matches)
        if self.outage.down or self._closed:
            self.counters.local_lookups += 1
            return local
        try:
            reply = await self._lookup_remote(skey, model, prefix_hashes)
        except UNAVAILABLE as exc:
            self._failed("lookup", exc)
            self.counters.local_lookups += 1
            return local
        self.counters.remote_lookups += 1
        pinned, matches = parse_lookup(reply)
        # This gateway's own recent writes may still be queued: what it knows locally counts too.
        for replica, blocks in local.prefix_matches.items():
            if blocks > matches.get(replica, 0):
                matches[replica] = blocks
        unsent = self.unsent_pin(skey) if skey is not None else None
        if unsent is not None:
            # This gateway's newer pin is still on its way to Redis (an outage's backlog draining):
            # it reads its own write, not the older pin Redis still holds.
            pinned = unsent
        elif pinned is None:
            # Not in Redis, and no pin of ours on its way: Redis lost it (a restart, or a write
            # dropped from a full backlog). Ours holds, and the decision's record writes it back.
            pinned = local.pinned
        elif skey is not None and session_key is not None:
            self.near.put(skey, pinned, now)
            if pinned != local.pinned:  # mirrored, so an outage keeps the pins peers made
                await self.local.record(session_key, pinned, (), now, True, model=model)
        return AffinityView(pinned=pinned, prefix_matches=matches)

    async def _lookup_remote(self, skey: str | None, model: str, hashes: Sequence[int]) -> Any:
        keys = (skey or self.keys.replicas(model), self.keys.replicas(model))
        args = (self.ttl_ms if skey else 0, self.prefix_ttl_ms, self.keys.prefix_base(model), pack_hashes(hashes))
        start = time.perf_counter()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                reply = await as_awaitable(self.client.evalsha(LOOKUP_SHA, 2, *keys, *args))
            except NoScriptError:  # a restarted or failed-over Redis forgot it: EVAL caches it again
                reply = await as_awaitable(self.client.eval(LOOKUP, 2, *keys, *args))
        self.observer.store_latency("lookup", time.perf_counter() - start)
        return reply

    async def record(
        self,
        session_key: str | None,
        replica: str,
        prefix_hashes: Sequence[int],
        now: float,
        pin: bool,
        *,
        model: str = "",
    ) -> None:
        """Pin and index at once locally; the Redis write is queued for the background writer."""
        await self.local.record(session_key, replica, prefix_hashes, now, pin, model=model)
        skey = self.keys.session(model, session_key) if session_key else None
        if skey is not None and pin:
            self.near.write(skey, replica, now)
        if self._closed:
            return
        self._queue(QueuedWrite(model, skey, replica, prefix_hashes, pin))

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound what ``replica`` is believed to hold, here and in Redis (each write trims the
        replica's index to it)."""
        self.local.set_capacity(replica, blocks)
        self.capacities[replica] = self.local.prefixes.capacity(replica)  # bounded as the local index

    async def forget_replica(self, replica: str) -> None:
        """Drop the replica's prefix entries here and, for every model, in Redis."""
        await self.local.forget_replica(replica)
        self.near.drop_replica(replica)
        if self.outage.down or self._closed:
            return  # its index expires after prefix_ttl_s; a gone replica is filtered out anyway
        try:
            async with asyncio.timeout(self.op_timeout_s * 4):
                members = await as_awaitable(self.client.smembers(self.keys.models_key))
                models = self._models | {m.decode() if isinstance(m, bytes) else str(m) for m in members}
                pipe = self.client.pipeline(transaction=False)
                for model in models:
                    pipe.delete(self.keys.prefix_index(model, replica))
                    pipe.zrem(self.keys.replicas(model), replica)
                await pipe.execute()
        except UNAVAILABLE as exc:
            self._failed("forget", exc)

    async def peek(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """The pin as Redis holds it (a plain GET: no TTL slides, no cache fills) and prefix matches
        from the local mirror (the search in Redis refreshes what it reads)."""
        local = await self.local.peek(session_key, prefix_hashes, now, model=model)
        if not session_key or self.outage.down or self._closed:
            return local
        try:
            async with asyncio.timeout(self.op_timeout_s):
                raw = await as_awaitable(self.client.get(self.keys.session(model, session_key)))
        except UNAVAILABLE as exc:
            self._failed("lookup", exc)
            return local
        pinned = raw.decode() if isinstance(raw, bytes) else raw
        return AffinityView(pinned=pinned or local.pinned, prefix_matches=local.prefix_matches)

    async def forget_session(self, session_key: str, *, model: str = "") -> bool:
        """Unpin here and in Redis."""
        skey = self.keys.session(model, session_key)
        self.near.discard(skey)
        dropped = await self.local.forget_session(session_key, model=model)
        if self.outage.down or self._closed:
            return dropped
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return bool(await as_awaitable(self.client.delete(skey))) or dropped
        except UNAVAILABLE as exc:
            self._failed("forget", exc)
            return dropped

    async def conversation(self, turn: int, now: float, *, model: str = "", refresh: bool = True) -> int | None:
        """The conversation of the chain ``turn``: from Redis (``GETEX``, sliding its TTL, or a plain
        ``GET`` without ``refresh``), else this gateway's mirror (an outage, or a write still queued)."""
        local = await self.local.conversation(turn, now, model=model, refresh=refresh)
        if self.outage.down or self._closed:
            return local
        key = self.keys.conversation(model, turn)
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.op_timeout_s):
                if refresh:
                    raw = await as_awaitable(self.client.getex(key, px=self.ttl_ms))
                else:
                    raw = await as_awaitable(self.client.get(key))
        except UNAVAILABLE as exc:
            self._failed("lookup", exc)
            return local
        self.observer.store_latency("lookup", time.perf_counter() - start)
        if raw is None:
            return local
        try:
            found = int(_text(raw), 16)
        except ValueError:  # not ours: a foreign value under our key is no conversation
            return local
        if refresh and found != local:  # mirrored, so an outage keeps what peers learned
            await self.local.remember_conversation(turn, found, now, model=model)
        return found

    async def remember_conversation(self, end: int, conversation: int, now: float, *, model: str = "") -> None:
        """Remember it here at once; the Redis write (a pin's write, without blocks) is queued."""
        await self.local.remember_conversation(end, conversation, now, model=model)
        if self._closed:
            return
        self._queue(QueuedWrite(model, self.keys.conversation(model, end), f"{conversation:x}", (), True))

    async def cordons(self) -> dict[str, str]:
        """The deployment's cordons from Redis; this gateway's last known ones while it is away."""
        if self.outage.down or self._closed:
            return await self.local.cordons()
        try:
            async with asyncio.timeout(self.op_timeout_s):
                raw = await as_awaitable(self.client.hgetall(self.keys.cordons_key))
        except UNAVAILABLE as exc:
            self._failed("lookup", exc)
            return await self.local.cordons()
        found = {_text(k): _text(v) for k, v in raw.items()}
        for name in set(await self.local.cordons()) - set(found):
            await self.local.set_cordon(name, None)
        for name, state in found.items():
            await self.local.set_cordon(name, state)
        return found

    async def set_cordon(self, replica: str, state: str | None) -> None:
        """Write the cordon to Redis (raises when Redis is away: an operator must know it did
        not reach the other gateways)."""
        async with asyncio.timeout(self.op_timeout_s * 4):
            if state is None:
                await as_awaitable(self.client.hdel(self.keys.cordons_key, replica))
            else:
                await as_awaitable(self.client.hset(self.keys.cordons_key, replica, state))
        await self.local.set_cordon(replica, state)

    def stats(self) -> StoreStats:
        """Sizes of the local mirror (this gateway's view; Redis holds the whole deployment's)."""
        return self.local.stats()

    async def close(self) -> None:
        """Send what is queued (briefly), stop the background tasks, close the connections."""
        if self._closed:
            return
        if self._pending and not self.outage.down:
            await self.flush(0.5)
        self._closed = True
        for task in (self._writer, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(*UNAVAILABLE):
            await self.client.aclose()

    def failed(self, operation: str, exc: BaseException) -> None:
        """A companion's call on :attr:`client` failed (the Responses transcripts): counted and,
        unless Redis refused only that call, an outage episode as the store's own failures."""
        self._failed(operation, exc)

    def __repr__(self) -> str:
        return f"RedisStore({self.outage.name}, namespace={self.keys.namespace!r})"
