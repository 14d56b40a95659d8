"""In-flight load across the workers of one host: each worker writes its own row, readers sum.

A worker publishes its counts for a replica whenever they change (:meth:`PeerLoad.publish`) and
adds every other worker's to its snapshot (:meth:`PeerLoad.others`), so that each decision sees
all the requests the host has in flight, not only its own. One writer per row: no lock, and a
read racing a write sees the old or the new count of a field, a transient error of one request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from extproc.routing.model import Replica
from extproc.state.shared_segment import LOAD_FIELDS, SharedSegment


@dataclass(frozen=True, slots=True)
class PeerCounts:
    """The other workers' load on one replica, summed."""

    inflight: int = 0
    inflight_tokens: int = 0
    pending_prefill_tokens: int = 0
    recent: float = 0.0


class OwnLoad(Protocol):
    """A worker's own counts on one replica, as it publishes them: a replica's record in
    :class:`~extproc.fleet.health.replicas.ReplicaBook` (a protocol, since the book above reads the
    other workers' counts from this module)."""

    replica: Replica
    inflight: int
    inflight_tokens: int
    pending_prefill_tokens: int
    requests: int
    recent: float
    recent_at: float


class PeerLoad:
    """Worker ``worker``'s view of the per-worker load rows in ``segment``."""

    def __init__(self, segment: SharedSegment, worker: int, recent_half_life_s: float = 10.0) -> None:
        if not 0 <= worker < segment.size.workers:
            raise ValueError(f"worker {worker}: the segment has rows for {segment.size.workers}")
        self.segment = segment
        self.worker = worker
        self.half_life_s = recent_half_life_s

    def _at(self, worker: int, row: int) -> int:
        seg = self.segment
        return int(seg.load_at + (worker * seg.size.replicas + row) * LOAD_FIELDS.size)

    def publish(self, rec: OwnLoad) -> None:
        """This worker's counts for ``rec``'s replica now (a replica without a row is not shared)."""
        row = self.segment.row_of(rec.replica.name, create=True)
        if row is None:
            return
        LOAD_FIELDS.pack_into(
            self.segment.buf,
            self._at(self.worker, row),
            rec.inflight,
            rec.inflight_tokens,
            rec.pending_prefill_tokens,
            rec.requests,
            rec.recent,
            rec.recent_at,
        )

    def others(self, now: float) -> dict[str, PeerCounts]:
        """Every other worker's load, per replica, with their recent counts decayed to ``now``."""
        out: dict[str, PeerCounts] = {}
        buf = self.segment.buf
        for row, name, _ in self.segment.replicas():
            inflight = tokens = prefill = 0
            recent = 0.0
            for worker in range(self.segment.size.workers):
                if worker == self.worker:
                    continue
                n, t, p, _, r, at = LOAD_FIELDS.unpack_from(buf, self._at(worker, row))
                inflight, tokens, prefill = inflight + max(0, n), tokens + max(0, t), prefill + max(0, p)
                if r > 0.0 and math.isfinite(r):
                    recent += r * 0.5 ** (max(0.0, now - at) / self.half_life_s)
            if inflight or tokens or prefill or recent:
                out[name] = PeerCounts(inflight, tokens, prefill, recent)
        return out

    def requests(self) -> list[int]:
        """Requests each worker has sent to the replicas, per worker: who served what."""
        buf = self.segment.buf
        rows = [row for row, _, _ in self.segment.replicas()]
        return [
            sum(LOAD_FIELDS.unpack_from(buf, self._at(w, row))[3] for row in rows)
            for w in range(self.segment.size.workers)
        ]
