"""What the router asks of the KV events: per replica, whether its feed is live, and its matches.

:class:`KvEventSource` owns the index and one :class:`FeedState` per replica, and applies messages
in sequence order. It performs no I/O of its own: replays go through a :data:`Replayer` passed in
(the ZMQ one in :mod:`.subscriber`, a fake in tests), and time comes from the clocks passed in.

Never silently wrong:
- a gap in the sequence asks the replayer for what was missed; if that cannot be had, the
  replica's entries are dropped (the estimate answers for it until its next stores);
- a sequence that goes backwards is an engine restart: its entries are dropped;
- a payload that does not decode is counted and dropped, and treated as a missed batch;
- a replica that is sent traffic while its feed stays silent for ``stale_after_s`` is stale: its
  matches come from the estimate until the feed speaks again;
- a feed that speaks but cannot be right is *suspended* (:meth:`KvEventSource.suspend`), its
  matches coming from the estimate: its engine's layout is not the one its model's prompts are
  hashed with (:mod:`.layout`; lifted when the layouts agree), or its predictions kept disagreeing
  with what the replica reported (lifted when they agree again, or when the feed resyncs).

Sequences are per engine: a server with data-parallel ranks runs one engine per rank, each
numbering its batches from 0 (each on its own port in the connect layout, all on one topic when
they connect to ``listen``). So every check above is made per (replica, ``data_parallel_rank``):
interleaved ranks are not gaps, and a rank's gap, restart or lost replay clears that rank only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import xxhash

from extproc.fleet.kvevents.feed_state import FeedState, Replayer, ReplayError, _replay_done, topic_parts
from extproc.fleet.kvevents.index import KvIndex
from extproc.fleet.kvevents.layout import EngineLayouts
from extproc.fleet.kvevents.observer import KvEventObserver, NullKvEventObserver
from extproc.fleet.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Message,
    WireError,
    decode_batch,
)

log = logging.getLogger("extproc.fleet.kvevents")


class KvEventSource:
    """The KV-event index and the feeds that fill it."""

    def __init__(
        self,
        index: KvIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: KvEventObserver | None = None,
        stale_after_s: float = 5.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index if index is not None else KvIndex()
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics: KvEventObserver = metrics or NullKvEventObserver()
        self.stale_after_s = stale_after_s
        self.feeds: dict[str, FeedState] = {}
        self.layouts: EngineLayouts | None = None
        """Where the block sizes of ``BlockStored`` events are reported (None: not followed)."""
        self.suspended: dict[str, set[str]] = {}
        """Replica -> why its feed is set aside although it speaks (see :meth:`suspend`)."""

    # -- feeds ------------------------------------------------------------------------------
    def add_feed(self, replica: str, replayer: Replayer | None = None, model: str = "", rank: int = 0) -> FeedState:
        """Register ``replica``'s feed, ``replayer`` answering for its ``rank`` (idempotent: a known
        feed keeps its state, takes the new replayer)."""
        state = self.feeds.get(replica)
        if state is None:
            state = self.feeds[replica] = FeedState(replica, model)
            self.metrics.feed_added(replica)
        stream = state.stream(rank)
        if replayer is not None:
            stream.replayer = replayer
        return state

    def remove_feed(self, replica: str) -> None:
        """``replica`` left the fleet: its feed and entries go."""
        self.feeds.pop(replica, None)
        self.index.drop_replica(replica)
        for cause in list(self.suspended.get(replica, ())):
            self.resume(replica, cause)
        if self.layouts is not None:
            self.layouts.forget(replica)

    def remove_rank(self, replica: str, rank: int) -> None:
        """``replica`` runs fewer engines: ``rank``'s stream and entries go."""
        state = self.feeds.get(replica)
        if state is not None:
            state.ranks.pop(rank, None)
        self.index.clear_replica(replica, rank)

    def is_live(self, replica: str, now: float) -> bool:
        """Whether ``replica``'s matches come from its events (else from the estimate)."""
        return not self.suspended.get(replica) and self.speaks(replica, now)

    def speaks(self, replica: str, now: float) -> bool:
        """Whether ``replica``'s feed is synced and not silent while serving (suspended or not)."""
        state = self.feeds.get(replica)
        if state is None or not state.synced:
            return False
        return state.routed_since is None or now - state.routed_since <= self.stale_after_s

    def suspend(self, replica: str, cause: str) -> bool:
        """Set ``replica``'s feed aside for ``cause`` (its matches come from the estimate); True
        when it was not already suspended for that cause."""
        causes = self.suspended.setdefault(replica, set())
        if cause in causes:
            return False
        causes.add(cause)
        self.metrics.feed_suspended(replica, cause)
        return True

    def resume(self, replica: str, cause: str) -> bool:
        """Lift ``replica``'s suspension for ``cause``; True when it was suspended for it."""
        causes = self.suspended.get(replica)
        if not causes or cause not in causes:
            return False
        causes.discard(cause)
        if not causes:
            del self.suspended[replica]
        self.metrics.feed_resumed(replica, cause)
        return True

    def refit(self) -> None:
        """Suspend the feeds whose engine's layout is not their model's (:meth:`EngineLayouts.misfit`),
        resume those that fit again."""
        if self.layouts is None:
            return
        for replica in list(self.layouts.reports):
            why = self.layouts.misfit(replica)
            for cause in ("block_size", "hash_algo"):
                if cause == why:
                    if self.suspend(replica, cause):
                        log.warning(
                            "kv events: %s's feed is not used: its engine's %s is not the one its model's prompts "
                            "are hashed with (the estimate answers for it)",
                            replica, cause,
                        )  # fmt: skip
                elif self.resume(replica, cause):
                    log.info("kv events: %s's feed is used again: its %s fits its model's", replica, cause)

    def live(self, replicas: Iterable[str], now: float) -> list[str]:
        """The live ones among ``replicas``."""
        return [r for r in replicas if self.is_live(r, now)]

    def note_routed(self, replica: str, now: float) -> None:
        """A request went to ``replica`` (its feed should speak soon)."""
        state = self.feeds.get(replica)
        if state is not None and state.routed_since is None:
            state.routed_since = now

    # -- lookups ----------------------------------------------------------------------------
    def matches(self, model: str, keys: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, float]:
        """Longest cached prefix of ``keys`` on each of ``replicas`` (live ones only), in blocks."""
        idx = self.index.for_request(model)
        if idx is None or not keys:
            return {}
        return idx.matches(keys, now, replicas)

    def holdings(
        self, model: str, keys: Sequence[int], replicas: Iterable[str], now: float
    ) -> dict[str, tuple[int, float]]:
        """Per replica of ``replicas``, its longest cached prefix of ``keys`` on any tier in blocks,
        and the same weighed by tier (:meth:`ModelIndex.holdings`)."""
        idx = self.index.for_request(model)
        if idx is None or not keys:
            return {}
        return idx.holdings(keys, now, replicas)

    def credit(self, model: str, replica: str, keys: Sequence[int], now: float) -> None:
        """Speculative credit for the replica a request was just sent to."""
        if replica in self.feeds and keys:
            idx = self.index.for_request(model)
            if idx is None:
                idx = self.index.model(self.feeds[replica].model)
            idx.credit(replica, keys, now)

    def apply_events(self, replica: str, events: Sequence[Event], model: str = "", rank: int = 0) -> None:
        """Apply decoded events of ``replica`` directly, with no sequence tracking (a source that
        cannot lose messages: the simulator's replicas)."""
        state = self.feeds.get(replica) or self.add_feed(replica, model=model)
        state.synced = True
        state.last_message_at = self.clock()
        state.routed_since = None
        self.index.model(model or state.model).apply(replica, events, rank)

    # -- messages ---------------------------------------------------------------------------
    async def catch_up(self, replica: str, rank: int = 0) -> bool:
        """Replay everything ``rank``'s publisher still buffers (a router that starts next to a
        running engine re-finds its cache); True when the replica's state is now known."""
        state = self.feeds[replica]
        if state.stream(rank).replayer is None:
            return False
        async with state.lock:
            return await self._catch_up(state, rank)

    async def _catch_up(self, state: FeedState, rank: int) -> bool:
        ok = await self._replay(state, rank, 0, None)
        if ok:
            state.synced = True
            stream = state.stream(rank)
            if stream.last_seq is None:
                stream.last_seq = -1  # nothing published yet: the first message must be seq 0
            stream.replayed_through = stream.last_seq
        return ok

    async def receive(self, msg: Message, replica: str | None = None) -> None:
        """Apply one message, from ``replica`` (else the replica its topic names)."""
        topic_replica, model = topic_parts(msg.topic)
        name = replica or topic_replica
        if name is None:
            self.metrics.messages_dropped("unknown")
            return
        state = self.feeds.get(name) or self.add_feed(name, model=model)
        if model:
            state.model = model
        async with state.lock:
            await self._receive(state, msg)

    async def reconnected(self, replica: str, rank: int = 0) -> None:
        """The connection to ``replica``'s publisher came back: messages may have been lost
        meanwhile (a PUB drops what it sends while no subscriber is connected), and the engine
        may be a new one. Ask its buffer from the last seq applied: the same engine still has
        that batch, and gives what followed; a new one does not, and is a restart."""
        state = self.feeds.get(replica)
        stream = state.ranks.get(rank) if state is not None else None
        if state is None or stream is None or stream.replayer is None or stream.last_seq is None or stream.last_seq < 0:
            return
        async with state.lock:
            last = stream.last_seq
            try:
                messages = sorted(await stream.replayer(last), key=lambda x: x.seq)
            except ReplayError as exc:
                self.metrics.replay_ended(replica, "failed")
                log.info("kv events: replay after reconnecting to %s failed: %s", replica, exc)
                return
            same = any(m.seq == last and xxhash.xxh3_64_intdigest(m.payload) == stream.last_digest for m in messages)
            if same:
                for m in messages:
                    if m.seq == stream.last_seq + 1:
                        self._apply(state, rank, m)
                self.metrics.replay_ended(replica, "ok")
                return
            self.metrics.engine_restarted(replica)
            self._clear(state, "restart", rank)
            log.info("kv events: %s is a new engine (reconnected): its entries are dropped", replica)
            stream.last_seq = None
            await self._catch_up(state, rank)

    async def _receive(self, state: FeedState, msg: Message) -> None:
        name = state.replica
        state.last_message_at = self.clock()
        state.routed_since = None
        m = self.metrics
        try:
            batch = decode_batch(msg.payload)
        except WireError as exc:
            m.messages_dropped(name)
            log.debug("kv events: undecodable batch %d from %s: %s", msg.seq, name, exc)
            return  # its seq is not taken: the next message of its engine shows the gap
        rank = batch.data_parallel_rank or 0
        stream = state.stream(rank)
        last = stream.last_seq
        if last is None or msg.seq == last + 1:
            if self._apply(state, rank, msg, batch):
                _replay_done(stream)  # the live stream has caught up with the replay
        elif msg.seq <= last:
            replayed = stream.replayed_digests.get(msg.seq) if msg.seq <= stream.replayed_through else None
            if replayed is not None and replayed == xxhash.xxh3_64_intdigest(msg.payload):
                return  # queued while we replayed: already applied
            m.engine_restarted(name)
            self._clear(state, "restart", rank)
            log.info("kv events: %s restarted (seq %d after %d): its entries are dropped", name, msg.seq, last)
            _replay_done(stream)
            if msg.seq > 0 and stream.replayer is not None:
                # What the new engine published before this message may not have reached us.
                await self._replay(state, rank, 0, msg.seq)
            self._apply(state, rank, msg, batch)
        else:
            m.gap_seen(name)
            ok = stream.replayer is not None and await self._replay(state, rank, last + 1, msg.seq)
            if not ok:
                self._clear(state, "gap", rank)
                log.info("kv events: %s lost seq %d..%d: its entries are dropped", name, last + 1, msg.seq - 1)
            self._apply(state, rank, msg, batch)
        state.synced = True

    async def _replay(self, state: FeedState, rank: int, start: int, before: int | None) -> bool:
        """Apply ``rank``'s replayed messages ``start <= seq < before``; False if any is missing."""
        stream = state.stream(rank)
        assert stream.replayer is not None
        label = state.replica
        try:
            messages = await stream.replayer(start)
        except ReplayError as exc:
            self.metrics.replay_ended(label, "failed")
            log.info("kv events: replay from %s for %s failed: %s", start, label, exc)
            return False
        expected = start
        for msg in sorted(messages, key=lambda x: x.seq):
            if msg.seq < expected:
                continue
            if before is None:
                # Catching up at start: a buffer that begins after ``start`` lacks only old stores
                # and the removals of those same blocks, so what it has is still right.
                if self._apply(state, rank, msg):
                    stream.replayed_digests[msg.seq] = stream.last_digest
            elif msg.seq >= before:
                break
            elif msg.seq != expected or not self._apply(state, rank, msg):
                self.metrics.replay_ended(label, "incomplete")
                return False
            expected = msg.seq + 1
        if before is not None and expected != before:
            self.metrics.replay_ended(label, "incomplete")
            return False
        self.metrics.replay_ended(label, "ok")
        return True

    def _apply(self, state: FeedState, rank: int, msg: Message, batch: EventBatch | None = None) -> bool:
        """Apply one of ``rank``'s messages (a replayed one is that rank's: its replay socket's)."""
        m = self.metrics
        name = state.replica
        if batch is None:
            try:
                batch = decode_batch(msg.payload)
            except WireError as exc:
                m.messages_dropped(name)
                log.debug("kv events: undecodable batch %d from %s: %s", msg.seq, name, exc)
                return False  # its seq is not taken: the next message shows the gap
        if batch.dropped:
            m.messages_dropped(name, batch.dropped)
        topic_model = topic_parts(msg.topic)[1]
        idx = self.index.model(topic_model or state.model)
        result = idx.apply(name, batch.events, rank)
        stream = state.stream(rank)
        stream.last_seq = msg.seq
        stream.last_digest = xxhash.xxh3_64_intdigest(msg.payload)
        state.last_message_at = self.clock()
        state.routed_since = None  # the feed works, replayed or live
        lag = self.wall_clock() - batch.ts
        m.batch_applied(name, lag if 0 <= lag < 3600 else None)  # beyond an hour: a clock is off
        kinds = {"stored": 0, "removed": 0, "cleared": 0}
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                kinds["stored"] += 1
            elif isinstance(ev, BlockRemoved):
                kinds["removed"] += 1
            elif isinstance(ev, AllBlocksCleared):
                kinds["cleared"] += 1
        for kind, n in kinds.items():
            if n:
                m.events_applied(name, kind, n)
        if kinds["stored"] and self.layouts is not None:
            # The engine's own block size: what its hashes were computed over (one per batch is enough).
            size = next(ev.block_size for ev in batch.events if isinstance(ev, BlockStored))
            if self.layouts.from_events(name, size):
                self.refit()
        if result.stored:
            m.blocks_changed(name, "stored", result.stored)
        if result.removed:
            m.blocks_changed(name, "removed", result.removed)
        if result.overflow:
            m.replica_cleared(name, "overflow")
        return True

    def _clear(self, state: FeedState, cause: str, rank: int | None = None) -> None:
        self.index.clear_replica(state.replica, rank)
        self.metrics.replica_cleared(state.replica, cause)
        # The index is rebuilt from what the engine publishes next: what its old entries predicted
        # no longer says anything about it.
        if self.resume(state.replica, "predictions"):
            log.info("kv events: %s's feed resyncs (%s): it is used again", state.replica, cause)

    def collect(self) -> None:
        """Refresh the gauges (before a metrics scrape)."""
        now = self.clock()
        m = self.metrics
        for name, state in self.feeds.items():
            m.feed_state(name, self.index.blocks(name), self.is_live(name, now), state.last_seq)
        m.index_keys(len(self.index))
