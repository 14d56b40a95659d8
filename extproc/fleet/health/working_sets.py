"""Each replica's live working set: the KV of their own that the conversations due back there
hold, which its cache keeps only while they fit it together.

vLLM evicts the least recently freed blocks first. A conversation's history survives until its
next turn only if what is prefilled there meanwhile fits beside it: in a closed loop every
conversation live there takes about one turn between two of its turns, so they all keep their
histories while their sum fits the cache, and once it does not, each turn evicts the next one
due. On real vLLM at 36 conversations / 18 live (4,096-token caches) a follow-up found 70-88% of
its prompt where under 1,500 uncached tokens had been prefilled beside it since its last turn,
and 17-22% (the system prompt) past 3,000, whichever router placed it
(``benchmarks/churn_between_turns.py``, ``benchmarks/realstack-vllm.md``).

Live here is not a fixed window: a conversation is due back within a few of its own gaps between
turns (the fleet's, before it has one), so one whose client stopped leaves the working set at the
pace its turns came, not a minute later.

Bounded and cheap: at most ``max_sessions`` conversations, least recently active dropped; a turn
is O(log n) (an expiry queued when it ends), a snapshot pops what expired since the last one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

GAP_FACTOR = 4.0
"""A conversation is counted live until this many of its gaps between turns have passed."""

MIN_GAP_S = 0.05
"""The shortest gap a conversation's liveness is reckoned from (a client that answers at once)."""

DEFAULT_GAP_S = 10.0
"""The gap assumed before any conversation has come back."""


@dataclass(slots=True)
class _Conversation:
    replica: str
    size: int = 0
    """The KV of its own it holds there: its turns' uncached tokens since it last recomputed."""
    inflight: int = 0
    last_end: float = 0.0
    gap_s: float | None = None
    counted: bool = False
    """Its size is in its replica's sum."""
    turn: int = 0
    """Its turns so far: an expiry queued by an earlier turn is stale."""


class WorkingSets:
    """Per replica, the KV of their own that its live conversations hold (:meth:`tokens`)."""

    def __init__(self, max_sessions: int = 100_000, max_live_s: float = 600.0) -> None:
        self.max_sessions = max_sessions
        self.max_live_s = max_live_s
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self._sums: dict[str, int] = {}
        self._expiries: list[tuple[float, int, str]] = []
        self._fleet_gap_s: float | None = None

    def __len__(self) -> int:
        return len(self._conversations)

    def begin(self, replica: str, session: str, now: float, uncached: int) -> None:
        """A turn of ``session`` was sent to ``replica`` with ``uncached`` tokens not believed held
        there: its history is that much larger there or, where it recomputes at least what it held
        (it moved, or its history was lost), that large."""
        c = self._conversations.get(session)
        if c is None:
            c = self._conversations[session] = _Conversation(replica)
            if len(self._conversations) > self.max_sessions:
                self._drop(next(iter(self._conversations)))
        elif c.inflight == 0 and c.turn:
            gap = max(0.0, now - c.last_end)
            c.gap_s = gap if c.gap_s is None else 0.5 * (c.gap_s + gap)
            self._fleet_gap_s = gap if self._fleet_gap_s is None else 0.9 * self._fleet_gap_s + 0.1 * gap
        self._uncount(c)
        added = max(0, uncached)
        c.size = added if c.replica != replica or added >= c.size else c.size + added
        c.replica = replica
        c.inflight += 1
        c.turn += 1
        self._count(c)
        self._conversations.move_to_end(session)

    def end(self, session: str, now: float) -> None:
        """A turn of ``session`` is over: its blocks are freed, cached until evicted; it stays in
        the working set for :data:`GAP_FACTOR` of its gaps."""
        c = self._conversations.get(session)
        if c is None or c.inflight == 0:
            return
        c.inflight -= 1
        c.last_end = now
        if c.inflight == 0:
            gap = c.gap_s if c.gap_s is not None else self._fleet_gap_s
            live_s = GAP_FACTOR * max(gap, MIN_GAP_S) if gap is not None else DEFAULT_GAP_S * GAP_FACTOR
            heapq.heappush(self._expiries, (now + min(live_s, self.max_live_s), c.turn, session))

    def tokens(self, now: float) -> Mapping[str, int]:
        """Per replica, the sizes of the conversations live there at ``now`` summed (replicas
        without any left out): the running sums themselves, read at once by the snapshot, not a
        copy for every decision."""
        while self._expiries and self._expiries[0][0] <= now:
            _, turn, session = heapq.heappop(self._expiries)
            c = self._conversations.get(session)
            if c is not None and c.turn == turn and c.inflight == 0:
                self._uncount(c)
        # Conversations long gone are kept no longer than their liveness could reach.
        while self._conversations:
            key, c = next(iter(self._conversations.items()))
            if c.inflight or c.counted or now - c.last_end <= self.max_live_s:
                break
            self._drop(key)
        return self._sums

    def forget(self, replica: str) -> None:
        """A replica left: its conversations hold nothing there."""
        for key in [k for k, c in self._conversations.items() if c.replica == replica]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self._uncount(self._conversations.pop(key))

    def _count(self, c: _Conversation) -> None:
        if not c.counted and c.size:
            self._sums[c.replica] = self._sums.get(c.replica, 0) + c.size
            c.counted = True

    def _uncount(self, c: _Conversation) -> None:
        if c.counted:
            left = self._sums.get(c.replica, 0) - c.size
            if left > 0:
                self._sums[c.replica] = left
            else:
                self._sums.pop(c.replica, None)
            c.counted = False
