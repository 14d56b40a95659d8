"""The built-in filters: replicas in rotation, not overloaded, of the request's pool, of its
tenant's shard, serving its adapter. Each drops candidates and says why (:class:`~extproc.routing.plugins.Filter`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.request.features import uncached_tokens
from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState


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

    This is what turns a prefix target into a spillover: new work that nothing ties to a replica
    never goes to one that is out of KV blocks.

    A replica holding more of the prompt than the median candidate (a session's pinned replica
    while nothing says its conversation is gone: all of it; otherwise what the index believes it
    holds, beyond a share ``holder_share`` of the prompt) is not dropped for its KV usage alone.
    On a real engine under pressure every replica's KV is near full with running requests
    (``vllm:kv_cache_usage_perc`` counts their blocks), and a turn sent elsewhere then recomputes
    its history on a replica as full, evicting other conversations there (real vLLM, 36
    conversations over 3 engines of 4,096 tokens: 25% hit ratio against a session hash's 28-37%).
    A holder whose KV is over the threshold is dropped only on evidence that waiting there costs
    more than moving: requests waiting in its queue (``vllm:num_requests_waiting``; a preempted
    request goes back there too), each worth ``waiting_tokens`` prompt tokens, more than the
    least-loaded other candidate's queue plus the tokens it would recompute there (what the holder
    holds beyond it). Where the profile's picker is the price, the same weighing is in its
    predicted seconds: the holder's predicted time to first token against the others'. No queue,
    no evidence: the request stays. Over ``queue_threshold`` a holder is dropped whatever it holds.
    A prefix most candidates hold (a shared system prompt) makes no holder: prefilled elsewhere,
    it costs nothing more.
    """

    kv_threshold: float = 0.9
    queue_threshold: int = 32
    holder_share: float = 0.0
    """The share of the prompt a replica must hold beyond the median candidate to be weighed as a
    holder (0: any more than the median). Below it, KV usage alone drops it."""
    waiting_tokens: int = 256
    """What one request waiting in a holder's queue is worth, in prompt tokens prefilled elsewhere
    (the load scorer's decode cost of a request, ``tokens_per_request``). Larger: spill sooner."""
    name: str = "overload"

    def __post_init__(self) -> None:
        if self.holder_share < 0 or self.waiting_tokens < 1:
            raise ValueError("holder_share must not be negative, waiting_tokens at least 1")

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

    def held_tokens(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> dict[str, int]:
        """The prompt tokens each candidate is believed to hold: a pinned replica without evidence
        of loss all of them, the others what the index says (their matched leading blocks)."""
        features, view = cycle.features, cycle.view
        prompt = features.estimated_prompt_tokens
        matches = view.prefix_matches
        out = {}
        for c in candidates:
            if c.name == view.pinned and view.pin_lost is None:
                out[c.name] = prompt
            else:
                out[c.name] = prompt - uncached_tokens(features, matches.get(c.name, 0), cycle.block_chars)
        return out

    def spill_pays(
        self, cycle: CycleState, state: ReplicaState, others: Sequence[ReplicaState], held: Mapping[str, int]
    ) -> bool:
        """Whether the holder ``state``'s queue costs more than moving to the best of ``others``."""
        if state.queue <= 0 or not others:
            return False  # no request waiting there: no evidence that staying costs anything
        if cycle.price_ttft is not None:
            stay_s = cycle.price_ttft(cycle, state)
            return any(cycle.price_ttft(cycle, o) < stay_s for o in others)
        stay = state.queue * self.waiting_tokens
        mine = held[state.name]
        return any(o.queue * self.waiting_tokens + max(0, mine - held[o.name]) < stay for o in others)

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop overloaded replicas (a holder of the prompt only where the spill pays)."""
        held = self.held_tokens(cycle, candidates)
        # What half of the candidates hold (a system prompt every replica serving has) is no
        # reason to keep a full replica: prefilled elsewhere, it costs nothing more.
        ranked = sorted(held.values())
        base = ranked[(len(ranked) - 1) // 2] if ranked else 0
        needed = base + self.holder_share * cycle.features.estimated_prompt_tokens

        def out(c: ReplicaState) -> bool:
            if not self.overloaded(c):
                return False
            if c.queue > self.queue_threshold or held[c.name] <= base or held[c.name] < needed:
                return True
            # Where it could go: a replica that takes new work (or holds the prompt too).
            others = [o for o in candidates if o is not c and (held[o.name] > base or not self.overloaded(o))]
            return self.spill_pays(cycle, c, others, held)

        kept = [c for c in candidates if not out(c)]
        if kept and len(kept) < len(candidates):
            # Only a replica the filter removed makes a spillover: when all are overloaded it
            # keeps them all, and a session then moves only by the scores (or stays).
            names = {c.name for c in kept}
            cycle.overloaded = frozenset(c.name for c in candidates if c.name not in names)
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Its KV usage or queue over the limits."""
        return (
            f"overloaded (kv usage {state.kv_usage:.2f}, limit {self.kv_threshold}; "
            f"queue {state.queue}, limit {self.queue_threshold}; a holder of the prompt only when "
            f"its queue costs more than moving)"
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
