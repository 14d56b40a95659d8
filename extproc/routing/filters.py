"""The built-in filters: replicas in rotation, not overloaded, of the request's pool, of its
tenant's shard, serving its adapter. Each drops candidates and says why (:class:`~extproc.routing.plugins.Filter`)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState
from extproc.routing.scorers import median_held


@dataclass(slots=True)
class InRotationFilter:
    """Keeps replicas that are in rotation; if none is, keeps all (fail open rather than 503)."""

    name: str = "in_rotation"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas out of rotation."""
        kept = [c for c in candidates if c.in_rotation]
        if not kept:
            return candidates
        return kept

    def why(self, state: ReplicaState) -> str:
        """Out of rotation."""
        return f"out of rotation (health {state.health:.2f})"


@dataclass(slots=True)
class OverloadFilter:
    """Drops overloaded replicas (KV usage or queue above a threshold) unless all of them are.

    This is what turns a sticky or prefix target into a spillover: affinity never pushes a
    replica that is out of KV blocks into preemption.

    A replica believed to hold at least ``holder_share`` of the prompt's blocks more than the
    median candidate is judged on its queue alone, not on its KV usage. Its full cache is mostly
    the running turns of the conversations it holds; sent elsewhere, the request is prefilled cold
    on a replica whose cache is as full, evicting other conversations' prefixes there, whose next
    turns then spill in turn (through real Envoy with 8 replicas at 1.65x the fleet's KV this
    cascade cut the hit ratio from 82% to 40% in 3 runs of 7). There it waits for blocks to free,
    which its queue shows and the queue threshold still bounds. A prefix most candidates hold (a
    shared system prompt) makes no holder: prefilled elsewhere, it costs nothing more.
    """

    kv_threshold: float = 0.9
    queue_threshold: int = 32
    holder_share: float = 0.5
    name: str = "overload"

    def overloaded(self, state: ReplicaState) -> bool:
        """Whether a replica should take no new work now.

        KV usage is the higher of the last scrape's and the KV the router's requests in flight
        there added (their prompts' uncached parts) over the cache's size: a scrape is up to an
        interval old, and in a burst the one replica that looked below the threshold would
        otherwise take every request until the next.
        """
        kv = state.kv_usage
        if state.kv_capacity_tokens:
            kv = max(kv, state.inflight_tokens / state.kv_capacity_tokens)
        return kv > self.kv_threshold or state.queue > self.queue_threshold

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop overloaded replicas (a holder of the prompt only for its queue)."""
        total = len(cycle.features.prefix_hashes)
        matches = cycle.view.prefix_matches
        # What half of the candidates hold (a system prompt every replica serving has) is no
        # reason to keep a full replica: prefilled elsewhere, it costs nothing more.
        base = median_held(matches, candidates)
        needed = base + self.holder_share * total

        def out(c: ReplicaState) -> bool:
            if total and matches.get(c.name, 0) >= needed:
                return c.queue > self.queue_threshold
            return self.overloaded(c)

        kept = [c for c in candidates if not out(c)]
        if len(kept) < len(candidates):
            names = {c.name for c in kept}
            cycle.overloaded = frozenset(c.name for c in candidates if c.name not in names)
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Its KV usage or queue over the limits."""
        return (
            f"overloaded (kv usage {state.kv_usage:.2f}, limit {self.kv_threshold}; "
            f"queue {state.queue}, limit {self.queue_threshold})"
        )


@dataclass(slots=True)
class PoolFilter:
    """Keeps the replicas of the request's pool (its class's label selector). An empty pool is a
    misconfiguration or an outage: then the whole fleet serves rather than nobody."""

    name: str = "pool"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas outside the pool."""
        selector = cycle.features.pool
        if not selector:
            return candidates
        kept = [c for c in candidates if all(c.replica.labels.get(k) == v for k, v in selector)]
        if not kept:
            return candidates
        return kept

    def why(self, state: ReplicaState) -> str:
        """Outside the pool."""
        return "outside the request's pool"


@dataclass(slots=True)
class TenantShardFilter:
    """Confines a tenant to its shard: the first ``shard_size`` replicas (its terms) on the ring
    from the tenant's name (stable as replicas come and go). Tenants without one use the fleet."""

    name: str = "tenant_shard"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas outside the tenant's shard."""
        size = cycle.tenant.shard_size
        if size <= 0:
            return candidates
        shard = set(cycle.ring.preference(f"tenant\x1f{cycle.features.tenant}", size))
        kept = [c for c in candidates if c.name in shard]
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Outside the shard."""
        return "outside the tenant's shard"
