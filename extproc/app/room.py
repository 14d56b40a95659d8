"""A routed request's wait for KV room on its replica (``queueing.kv_room``), and the room given
back when the request is over: :class:`~extproc.fleet.queueing.kv_room.RoomGate` fed from what
the router knows of the request and of its replica."""

from __future__ import annotations

from collections.abc import Callable

from extproc.core.bookkeeping import Routed
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing.kv_room import RoomGate
from extproc.fleet.queueing.observer import QueueObserver


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

    async def hold(self, routed: Routed) -> None:
        """Return once the request's replica has room for it (or its limit passed). Its claim: its
        prompt and expected output, its prompt's blocks (over the model's tokens where tokenized,
        else characters) counted once beside the others' on that replica."""
        replica = routed.decision.replica
        if replica is None or routed.refusal is not None:
            return
        record = self.replicas.record(replica.name)
        capacity = record.metrics.kv_capacity_tokens if record is not None and record.metrics is not None else 0
        features = routed.features
        tokens = features.estimated_prompt_tokens + (features.expected_output_tokens or 0)
        block_tokens = features.tokens_per_block or self.char_block_tokens
        blocks = features.prefix_hashes[: tokens // block_tokens] if block_tokens else ()
        since = self.clock()
        routed.room = await self.gate.enter(replica.name, features.session_key, tokens, capacity, blocks, block_tokens)
        now = self.clock()
        self.metrics.kv_room_waited(now - since)
        routed.decided_at = now  # sent now: the time from here on is the engine's

    def give_back(self, routed: Routed) -> None:
        """The request is over: its room goes to what waits (a moment first to its conversation)."""
        if routed.room is not None:
            room, routed.room = routed.room, None
            self.gate.leave(room)
