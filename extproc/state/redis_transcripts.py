"""Responses API conversations in Redis, for a follow-up that another gateway routes.

vLLM keeps a Responses conversation under its response id and prepends it to a request that names
it as ``previous_response_id``. To hash such a follow-up in the engine's key space the router
needs that conversation (:mod:`extproc.fleet.kvevents.responses`): the gateway that routed the turn
before knows it, and with a Redis store it also writes it here, so a follow-up that Envoy hands
to another gateway is hashed as the first gateway would have hashed it. (Its pin needs nothing of
this: the response id's link to its conversation is already a shared key, see
:mod:`extproc.state.conversations`.)

One key a response, ``ext:{T}:t:<link>`` (:meth:`~extproc.state.redis_keys.KeySpace.transcript`),
holding the caller's opaque bytes, with the sessions' TTL from when it was written (a read slides
nothing: Explain reads too, and a conversation's next turn writes a key of its own). Bounded: bytes
over ``max_bytes`` are not written (their follow-up is routed by its pin and predicted without its
conversation, as before this existed), and at most ``max_writes`` writes are in flight (past that a
write is dropped and counted).

Writes go behind the answer, as the store's pins go behind the decision: another gateway may not
see a conversation until one round trip after the answer's last byte went to Envoy, which is
earlier than a client's next turn except for one sent at once by a machine.

**An outage costs only the optimisation.** While the store is in an outage episode nothing is
read or written here; a failed call is counted as the store's (``operation="transcript"``) and,
unless Redis refused only that call, starts an episode as the store's own failures do. Nothing
raises into the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, cast

from extproc.state.redis_client import UNAVAILABLE
from extproc.state.redis_store import RedisStore
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.state")

OPERATION = "transcript"
"""The store operation (a metric label) that transcripts' reads and writes count under."""


@dataclass(slots=True)
class TranscriptCounters:
    """What the transcripts did, for tests and benchmarks (errors go through the store's observer)."""

    fetched: int = 0
    missed: int = 0
    written: int = 0
    dropped: int = 0
    too_large: int = 0


class RedisTranscripts:
    """Responses conversations, by model and link, in the Redis of a :class:`RedisStore`."""

    def __init__(self, store: RedisStore, max_bytes: int, max_writes: int = 64) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.max_writes = max_writes
        self.counters = TranscriptCounters()
        self._writes: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def usable(self) -> bool:
        """Whether Redis is to be tried now (not in an outage episode, not closed)."""
        return self.store.available and not self._closed

    async def fetch(self, model: str, link: str) -> bytes | None:
        """The bytes kept for ``link``; None when none are, or Redis is away."""
        if not self.usable:
            return None
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.store.op_timeout_s):
                key = self.store.keys.transcript(model, link)
                raw = await cast("Awaitable[Any]", self.store.client.get(key))
        except UNAVAILABLE as exc:
            self.store.failed(OPERATION, exc)
            return None
        self.store.observer.store_latency(OPERATION, time.perf_counter() - start)
        if not isinstance(raw, bytes):  # none, or not ours (a client decoding replies): not a transcript
            self.counters.missed += 1
            return None
        self.counters.fetched += 1
        return raw

    def keep(self, model: str, link: str, payload: bytes) -> None:
        """Write ``payload`` for ``link`` behind the caller (on the running event loop)."""
        if len(payload) > self.max_bytes:
            self.counters.too_large += 1
            return
        if not self.usable or len(self._writes) >= self.max_writes:
            self.counters.dropped += 1
            return
        try:
            task = asyncio.get_running_loop().create_task(self._write(model, link, payload))
        except RuntimeError:  # no loop: a caller outside the server (a script); nothing is shared
            self.counters.dropped += 1
            return
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, model: str, link: str, payload: bytes) -> None:
        start = time.perf_counter()
        key = self.store.keys.transcript(model, link)
        try:
            async with asyncio.timeout(self.store.op_timeout_s + len(payload) / 50e6):  # ~50 MB/s at worst
                await cast("Awaitable[Any]", self.store.client.set(key, payload, px=self.store.ttl_ms))
        except UNAVAILABLE as exc:
            self.counters.dropped += 1
            self.store.failed(OPERATION, exc)
            return
        self.counters.written += 1
        self.store.observer.store_latency(OPERATION, time.perf_counter() - start)

    async def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait until every write in flight ended; False if that did not happen in time."""
        pending = set(self._writes)
        if not pending:
            return True
        done, _ = await asyncio.wait(pending, timeout=timeout_s)
        return len(done) == len(pending)

    async def close(self) -> None:
        """Let the writes in flight end (briefly), then stop taking more."""
        await self.flush(0.5)
        self._closed = True
        for task in list(self._writes):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def redis_transcripts(store: AffinityStore, max_bytes: int) -> RedisTranscripts | None:
    """Transcripts shared through ``store`` when it is Redis; None otherwise (kept in memory)."""
    return RedisTranscripts(store, max_bytes) if isinstance(store, RedisStore) else None
