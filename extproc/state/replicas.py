"""What the gateway knows about each replica between scrapes: in-flight work it sent there, and
what real traffic showed (status codes, time to first byte).

In-flight counts change at decision time, not after the next scrape, so a burst of new
sessions spreads over replicas instead of herding onto the one that looked idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from extproc.routing.model import Replica, ReplicaState, Snapshot


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A replica's load as the replica itself reports it (its /metrics page, or a simulator)."""

    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class ReplicaRecord:
    """Mutable per-replica bookkeeping behind a :class:`ReplicaState`."""

    replica: Replica
    inflight: int = 0
    pending_prefill_tokens: int = 0
    recent: float = 0.0
    recent_at: float = 0.0
    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0
    health: float = 1.0
    consecutive_failures: int = 0
    out_until: float = 0.0
    ttfb: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    requests: int = 0
    errors: int = 0


class ReplicaBook:
    """All replicas' records; produces the immutable :class:`Snapshot` each decision reads.

    Passive ejection: ``eject_after`` consecutive upstream failures (connect errors, 502/503/504)
    take a replica out of rotation for ``eject_s`` seconds; any success resets the count.
    """

    def __init__(
        self, replicas: Iterable[Replica], eject_after: int = 3, eject_s: float = 5.0, recent_half_life_s: float = 60.0
    ) -> None:
        self._records: dict[str, ReplicaRecord] = {r.name: ReplicaRecord(r) for r in replicas}
        self.eject_after = eject_after
        self.eject_s = eject_s
        self.recent_half_life_s = recent_half_life_s

    def _decayed(self, rec: ReplicaRecord, now: float) -> float:
        if rec.recent == 0.0 or now <= rec.recent_at:
            return rec.recent
        return float(rec.recent * 0.5 ** ((now - rec.recent_at) / self.recent_half_life_s))

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def records(self) -> list[ReplicaRecord]:
        """All records (for metrics)."""
        return list(self._records.values())

    def snapshot(self, now: float) -> Snapshot:
        """Every replica's state at ``now``."""
        return Snapshot(
            tuple(
                ReplicaState(
                    replica=r.replica,
                    in_rotation=r.out_until <= now,
                    health=r.health,
                    inflight=r.inflight,
                    pending_prefill_tokens=r.pending_prefill_tokens,
                    recent_requests=self._decayed(r, now),
                    queue=r.queue,
                    running=r.running,
                    kv_usage=r.kv_usage,
                )
                for r in self._records.values()
            )
        )

    def apply_report(self, name: str, report: LoadReport) -> None:
        """Take in what the replica reported about its own load."""
        rec = self._records.get(name)
        if rec is not None:
            rec.queue = report.queue
            rec.running = report.running
            rec.kv_usage = report.kv_usage

    def begin(self, name: str, now: float, prefill_tokens: int = 0) -> None:
        """A request was sent to ``name``, with about ``prefill_tokens`` of its prompt uncached there."""
        rec = self._records.get(name)
        if rec is not None:
            rec.recent = self._decayed(rec, now) + 1.0
            rec.recent_at = now
            rec.inflight += 1
            rec.requests += 1
            rec.pending_prefill_tokens += prefill_tokens

    def prefilled(self, name: str, prefill_tokens: int) -> None:
        """The first byte came back: that request's prefill is done."""
        rec = self._records.get(name)
        if rec is not None:
            rec.pending_prefill_tokens = max(0, rec.pending_prefill_tokens - prefill_tokens)

    def end(self, name: str, prefill_tokens: int = 0) -> None:
        """A request to ``name`` finished (or was abandoned); ``prefill_tokens`` still pending are dropped."""
        rec = self._records.get(name)
        if rec is not None and rec.inflight > 0:
            rec.inflight -= 1
            rec.pending_prefill_tokens = max(0, rec.pending_prefill_tokens - prefill_tokens)

    def observe(self, name: str, status: int, ttfb_s: float | None, now: float) -> None:
        """Learn from a response seen by Envoy: its status and its time to first byte."""
        rec = self._records.get(name)
        if rec is None:
            return
        if ttfb_s is not None:
            rec.ttfb.append(ttfb_s)
        if status in (502, 503, 504) or status == 0:
            rec.errors += 1
            rec.consecutive_failures += 1
            if rec.consecutive_failures >= self.eject_after:
                rec.out_until = now + self.eject_s
                rec.consecutive_failures = 0
        else:
            rec.consecutive_failures = 0
