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


@dataclass(slots=True)
class ReplicaRecord:
    """Mutable per-replica bookkeeping behind a :class:`ReplicaState`."""

    replica: Replica
    inflight: int = 0
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

    def __init__(self, replicas: Iterable[Replica], eject_after: int = 3, eject_s: float = 5.0) -> None:
        self._records: dict[str, ReplicaRecord] = {r.name: ReplicaRecord(r) for r in replicas}
        self.eject_after = eject_after
        self.eject_s = eject_s

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
                    queue=r.queue,
                    running=r.running,
                    kv_usage=r.kv_usage,
                )
                for r in self._records.values()
            )
        )

    def begin(self, name: str) -> None:
        """A request was sent to ``name``."""
        rec = self._records.get(name)
        if rec is not None:
            rec.inflight += 1
            rec.requests += 1

    def end(self, name: str) -> None:
        """A request to ``name`` finished (or was abandoned)."""
        rec = self._records.get(name)
        if rec is not None and rec.inflight > 0:
            rec.inflight -= 1

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
