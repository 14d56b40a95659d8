"""A routed request's wait for KV room on its replica (``queueing.kv_room``), a new conversation's
wait for room on any replica before it is decided, and the room given back when the request is
over: :class:`~extproc.fleet.queueing.room_gate.RoomGate` fed from what the router knows of the
request and of its replicas."""

from __future__ import annotations

from collections.abc import Callable

from extproc.core.bookkeeping import Routed
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing.kv_room import Entry
from extproc.fleet.queueing.observer import QueueObserver
from extproc.fleet.queueing.room_gate import RoomGate
from extproc.request.features import RequestFeatures


class RoomKeeper:
    """Holds a routed request until its replica has KV room for it; gives the room back at its end."""

    def __init__(
        self,
        gate: RoomGate,
        replicas: ReplicaBook,
        metrics: QueueObserver,
        clock: Callable[[], float],
        char_block_tokens: int,
    ) -> None:
        self.gate = gate
        self.replicas = replicas
        self.metrics = metrics
        self.clock = clock
        self.char_block_tokens = char_block_tokens
        """A character block's tokens (about four characters a token): an untokenized prompt's."""

    def arrived(self, session: str) -> None:
        """A turn of ``session`` came, before it is decided: the room kept for it waits for it."""
        self.gate.arrived(session)

    def full(self, features: RequestFeatures) -> frozenset[str]:
        """The replicas ``features``, a new conversation, would wait for room on now."""
        entry = self._entry("", features)
        would_wait = self.gate.would_wait
        return frozenset(
            rec.replica.name
            for rec in self.replicas.records()
            if rec.kv_capacity_tokens > 0 and would_wait(entry, rec.replica.name, rec.kv_capacity_tokens)
        )

    async def await_any(self, features: RequestFeatures, among: frozenset[str]) -> Entry:
        """Wait until one of ``among`` has room for ``features``, a new conversation: its claim
        there (or, its time up, nowhere: :meth:`hold` then sends it where it is decided)."""
        entry = self._entry("", features)
        entry.among = among
        await self.gate.enter_any(entry)
        self.metrics.kv_room_waited(self.clock() - entry.since)
        return entry

    async def hold(self, routed: Routed) -> None:
        """Return once the request's replica has room for it (or its limit passed). Its claim: its
        prompt and expected output, its prompt's blocks (over the model's tokens where tokenized,
        else characters) counted once beside the others' on that replica. A new conversation that
        waited for room before its decision (:meth:`await_any`) has it already where it went."""
        replica = routed.decision.replica
        if replica is None or routed.refusal is not None:
            return
        waited, held = 0.0, routed.room
        if held is not None:
            if held.inside and held.replica == replica.name:
                return
            self.gate.leave(held, keep=False)  # it went elsewhere after all: the room it waited for goes
            waited = self.clock() - held.since
        entry = self._entry(replica.name, routed.features)
        record = self.replicas.record(replica.name)
        capacity = record.kv_capacity_tokens if record is not None else 0
        routed.room = await self.gate.enter(entry, capacity, waited)
        now = self.clock()
        self.metrics.kv_room_waited(now - entry.since)
        routed.decided_at = now  # sent now: the time from here on is the engine's

    def give_back(self, routed: Routed) -> None:
        """The request is over: its room goes to what waits (a moment first to its conversation)."""
        if routed.room is not None:
            room, routed.room = routed.room, None
            self.gate.leave(room)

    def _entry(self, replica: str, features: RequestFeatures) -> Entry:
        tokens = features.estimated_prompt_tokens + (features.expected_output_tokens or 0)
        block_tokens = features.tokens_per_block or self.char_block_tokens
        blocks = features.prefix_hashes[: tokens // block_tokens] if block_tokens else ()
        return Entry(replica, features.session_key, tokens, self.clock(), blocks, block_tokens)
