"""A replica's KV-event feed as :class:`~extproc.fleet.kvevents.feed.KvEventSource` tracks it: one
sequence per data-parallel rank, what a replay brought, and when it last spoke."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from extproc.fleet.kvevents.wire import Message

Replayer = Callable[[int], Awaitable[Sequence[Message]]]
"""Asks a publisher for its buffered messages with seq >= start; raises :class:`ReplayError`."""


class ReplayError(Exception):
    """A replay that could not be had (no answer, a broken answer)."""


@dataclass(slots=True)
class RankStream:
    """One engine's sequence in a replica's feed (its data-parallel rank; 0 without DP)."""

    replayer: Replayer | None = None
    last_seq: int | None = None
    replayed_through: int = -1
    """Messages up to here came from a replay: the same seqs arriving live are duplicates."""
    replayed_digests: dict[int, int] = field(default_factory=dict)
    """Seq -> payload hash of what the replay applied: a live message with a replayed seq is a
    duplicate only if it is the same batch (a new engine restarts its seqs at 0)."""
    last_digest: int = 0
    """A hash of the last applied payload: after a reconnect, tells the same engine from a new one."""


@dataclass(slots=True)
class FeedState:
    """One replica's feed: one :class:`RankStream` per data-parallel rank heard of."""

    replica: str
    model: str = ""
    ranks: dict[int, RankStream] = field(default_factory=dict)
    synced: bool = False
    """The index holds this replica's state: caught up by a replay, or a message seen."""
    last_message_at: float = float("-inf")
    routed_since: float | None = None
    """The first request sent there since its last message (for staleness)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def stream(self, rank: int = 0) -> RankStream:
        """Rank ``rank``'s sequence (created on first use)."""
        stream = self.ranks.get(rank)
        if stream is None:
            stream = self.ranks[rank] = RankStream()
        return stream

    @property
    def last_seq(self) -> int | None:
        """The lowest rank's last applied sequence number (rank 0's without DP)."""
        return self.ranks[min(self.ranks)].last_seq if self.ranks else None


def _replay_done(stream: RankStream) -> None:
    stream.replayed_through = -1
    stream.replayed_digests.clear()


def topic_parts(topic: str) -> tuple[str | None, str]:
    """(replica, model) from ``kv@<replica>@<model>``; (None, "") for another topic."""
    parts = topic.split("@", 2)
    if len(parts) == 3 and parts[0] == "kv" and parts[1]:
        return parts[1], parts[2]
    return None, ""
