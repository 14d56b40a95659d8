"""A sampled feed of decisions for watchers (the admin API's WatchDecisions).

What goes out is a :class:`DecisionSummary`: reason, replica, model, matched blocks, latency, and
in a disaggregated fleet the prefill replica and the pair's reason.
Never the prompt, the session key, the request id or any header: a watcher can be anyone holding
the admin listener's read access. With nobody watching, publishing is skipped by the router.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from extproc.routing.model import Decision


@dataclass(frozen=True, slots=True)
class DecisionSummary:
    """One decision, as much as a watcher may see."""

    time: float
    replica: str
    reason: str
    model: str
    matched_blocks: int
    total_blocks: int
    decision_ms: float
    skipped: int = 0
    """Decisions this watcher did not get since the previous one (sampling or a full queue)."""
    prefill: str = ""
    """The replica that prefills for ``replica`` (empty: no prefill hop)."""
    pair_reason: str = ""
    """Why the pair is what it is (:class:`~extproc.routing.roles.PairReason`); empty for a fleet
    without roles."""


class _Watcher:
    __slots__ = ("credit", "queue", "rate", "skipped")

    def __init__(self, rate: float, size: int) -> None:
        self.queue: asyncio.Queue[DecisionSummary] = asyncio.Queue(size)
        self.rate = rate
        self.credit = 0.0
        self.skipped = 0


class DecisionFeed:
    """Fans decisions out to watchers, each at its own sample rate, never blocking the router."""

    def __init__(self, queue_size: int = 256, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall  # what a summary is stamped with (the world's wall clock)
        self._watchers: list[_Watcher] = []
        self._queue_size = queue_size

    @property
    def watched(self) -> bool:
        """Whether anyone is watching (the router skips :meth:`publish` otherwise)."""
        return bool(self._watchers)

    def publish(self, decision: Decision, model: str, seconds: float) -> None:
        """Offer one decision to every watcher."""
        summary: DecisionSummary | None = None
        for w in self._watchers:
            # Deterministic sampling: at rate 0.25 exactly every fourth decision goes out.
            w.credit += w.rate
            if w.credit < 1.0 or w.queue.full():
                w.skipped += 1
                continue
            w.credit -= 1.0
            if summary is None:
                replica = decision.replica
                summary = DecisionSummary(
                    self.wall(),
                    replica.name if replica is not None else "",
                    decision.reason.value,
                    model,
                    decision.matched_blocks,
                    decision.total_blocks,
                    round(seconds * 1000, 3),
                    prefill=decision.prefill.name if decision.prefill is not None else "",
                    pair_reason=decision.pair.value if decision.pair is not None else "",
                )
            w.queue.put_nowait(replace(summary, skipped=w.skipped) if w.skipped else summary)
            w.skipped = 0

    async def watch(self, sample_rate: float = 1.0) -> AsyncIterator[DecisionSummary]:
        """Decisions as they are made, a ``sample_rate`` share of them, until the caller stops."""
        watcher = _Watcher(min(1.0, max(1e-6, sample_rate)), self._queue_size)
        self._watchers.append(watcher)
        try:
            while True:
                yield await watcher.queue.get()
        finally:
            self._watchers.remove(watcher)
