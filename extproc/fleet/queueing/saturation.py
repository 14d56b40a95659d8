"""Whether every replica a request could go to is saturated. Pure."""

from __future__ import annotations

from extproc.fleet.queueing.settings import QueueSettings
from extproc.routing.model import ReplicaState, Snapshot


def replica_saturated(state: ReplicaState, settings: QueueSettings) -> bool:
    """Whether one replica should take no new work now."""
    # Requests sent since the last scrape are not in its queue yet: what this router has in flight
    # beyond what the replica was running is a lower bound of its queue now.
    waiting = max(state.queue, state.inflight - state.running)
    if state.kv_usage > settings.kv_threshold or waiting > settings.queue_threshold:
        return True
    return 0 < settings.max_inflight_per_replica <= state.inflight


def saturated(snapshot: Snapshot, pool: tuple[tuple[str, str], ...], settings: QueueSettings) -> bool:
    """Whether every in-rotation replica of the pool (the whole rotation when the pool has none,
    as the pool filter does; every replica when none is in rotation) is saturated. No replica at
    all is not saturation: the decision answers that one."""
    # With the whole fleet out of rotation the decision still routes over all of it: so do we.
    live = [s for s in snapshot.replicas if s.in_rotation] or list(snapshot.replicas)
    candidates = [s for s in live if all(s.replica.labels.get(k) == v for k, v in pool)] or live
    return bool(candidates) and all(replica_saturated(s, settings) for s in candidates)
