"""The built-in filters: replicas in rotation, not overloaded, of the request's pool, of its
tenant's shard, serving its adapter. Each drops candidates and says why (:class:`~extproc.routing.plugins.Filter`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from extproc.request.features import uncached_tokens
from extproc.routing.model import WAITING_REQUEST_TOKENS, ReplicaState
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
    """Drops overloaded replicas (a full cache with work waiting for room, or a long queue) unless
    all of them are.

    This is what turns a prefix target into a spillover: new work never goes to a replica that is
    out of KV blocks for a prefix match's sake. Out of blocks means new work would wait there: the
    cache is full (KV usage over ``kv_threshold``) *and* requests wait for room (the engine's
    ``vllm:num_requests_waiting``, or what the router sent there beyond the cache). A full cache
    alone says little: ``vllm:kv_cache_usage_perc`` counts the running requests' blocks, and under
    pressure every engine is near full with running requests while still admitting new ones as
    they finish (on the real engines of benchmarks/realstack-vllm.md, a KV usage threshold alone
    put all but one engine over it at once, and new conversations herded onto that one).

    A session's pinned replica is not dropped for being overloaded alone. Under pressure every replica
    may look full (``vllm:kv_cache_usage_perc`` counts the running requests' blocks; the router's
    own count of what it sent there counts queued prompts too, and on queue-bound real vLLM engines
    it is mostly that count that passes 0.9: benchmarks/realstack-vllm.md), and a turn sent
    elsewhere recomputes its history on a replica as full, evicting other conversations there.
    The pin is dropped only on evidence that waiting there costs more than moving: the requests
    waiting in its queue (``vllm:num_requests_waiting``; a preempted request goes back there too),
    each worth ``waiting_tokens`` prompt tokens, more than the queue of the least loaded candidate
    that could take the turn plus the prompt tokens it would recompute there (what the pin holds
    beyond it: all of the prompt while nothing says the conversation is gone, else what the index
    believes). Where the profile's picker is the price, the same weighing is in its predicted
    seconds: the pin's predicted time to first token against the others'. No queue, no evidence: the
    session stays. Over ``queue_threshold`` it goes whatever it holds.

    Any other replica believed to hold at least ``holder_share`` of the prompt's blocks more than
    the median candidate is judged on its queue alone, not on its KV usage: sent elsewhere, the
    request is prefilled cold on a replica whose cache is as full (through real Envoy with 8
    replicas at 1.65x the fleet's KV this cascade cut the hit ratio from 82% to 40% in 3 runs of
    7). A prefix most candidates hold (a shared system prompt) makes no holder: prefilled
    elsewhere, it costs nothing more.
    """

    kv_threshold: float = 0.9
    queue_threshold: int = 32
    holder_share: float = 0.5
    waiting_tokens: int = WAITING_REQUEST_TOKENS
    """What one request waiting in a pinned replica's queue is worth, in prompt tokens prefilled
    elsewhere (the load scorer's decode cost of a request, ``tokens_per_request``). Larger: a
    session spills sooner. Also the size of a waiting request when the router's own count says
    how many wait (:meth:`waiting`)."""
    waiting_threshold: float = 16.0
    """Requests waiting at a replica whose cache is full beyond which it takes no new work. Not 0
    (any request waiting there): on real vLLM engines under KV pressure (36 conversations, 18 live,
    on 3 engines of 128 blocks: benchmarks/realstack-vllm.md) a few requests wait at every engine
    most of the time, and at 0 most new conversations had one or two candidates (22 of 36 first
    turns in a logged run), their prefix's holder often filtered out; ours found 20-25% in cache
    over seven runs. At 16 the busy replicas stay candidates, weighed by the scorers' queued
    prefill: 33-37% over three runs, TTFT p99 2.6-3.3 s against 2.9-3.8 s, no turn spilled (5 and
    17 at 0), the requests per engine as level; the simulator's committed tables moved within
    their noise (benchmarks/ours_against_committed.md)."""
    name: str = "overload"

    def __post_init__(self) -> None:
        if self.holder_share < 0 or self.waiting_tokens < 1 or self.waiting_threshold < 0:
            raise ValueError("holder_share and waiting_threshold must not be negative, waiting_tokens at least 1")

    def waiting(self, state: ReplicaState) -> float:
        """Requests believed waiting at a replica for room: the engine's queue as last scraped, or,
        if more, what the router's requests in flight there need beyond the cache (their prompts'
        uncached parts cannot all be held at once), counted in ``waiting_tokens`` per request."""
        beyond = 0.0
        if state.kv_capacity_tokens:
            beyond = max(0, state.inflight_tokens - state.kv_capacity_tokens) / self.waiting_tokens
        return max(float(state.queue), beyond)

    def overloaded(self, state: ReplicaState) -> bool:
        """Whether a replica should take no new work now: its queue is over ``queue_threshold``, or
        its cache is full and work waits there for room (:meth:`waiting` over ``waiting_threshold``).

        KV usage is the higher of the last scrape's and the KV the router's requests in flight
        there added (their prompts' uncached parts) over the cache's size: a scrape is up to an
        interval old, and in a burst the one replica that looked free would otherwise take every
        request until the next (what it was sent beyond its cache counts as waiting).
        """
        if state.queue > self.queue_threshold:
            return True
        kv = state.kv_usage
        if state.kv_capacity_tokens:
            kv = max(kv, state.inflight_tokens / state.kv_capacity_tokens)
        return kv > self.kv_threshold and self.waiting(state) > self.waiting_threshold

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
        self, cycle: CycleState, pin: ReplicaState, others: Sequence[ReplicaState], held: Mapping[str, int]
    ) -> bool:
        """Whether the pinned replica's queue costs more than moving the turn to the best of ``others``."""
        if pin.queue <= 0 or not others:
            return False  # no request waiting there: no evidence that staying costs anything
        if cycle.price_ttft is not None:
            stay_s = cycle.price_ttft(cycle, pin)
            if stay_s is not None:
                moves = (cycle.price_ttft(cycle, o) for o in others)
                return any(s is not None and s < stay_s for s in moves)
        stay = pin.queue * self.waiting_tokens
        mine = held[pin.name]
        return any(o.queue * self.waiting_tokens + max(0, mine - held.get(o.name, 0)) < stay for o in others)

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop overloaded replicas (the session's pin only where the spill pays, a holder of the
        prompt only for its queue)."""
        total = len(cycle.features.prefix_hashes)
        matches = cycle.view.prefix_matches
        pinned = cycle.view.pinned
        # What half of the candidates hold (a system prompt every replica serving has) is no
        # reason to keep a full replica: prefilled elsewhere, it costs nothing more.
        base = median_held(matches, candidates)
        needed = base + self.holder_share * total

        def holder(c: ReplicaState) -> bool:
            return bool(total) and matches.get(c.name, 0) >= needed

        def out(c: ReplicaState) -> bool:
            if c.queue > self.queue_threshold:
                return True
            if c.name == pinned:
                return self.overloaded(c) and self._pin_goes(cycle, c, candidates, holder)
            if holder(c):
                return False
            return self.overloaded(c)

        kept = [c for c in candidates if not out(c)]
        if kept and len(kept) < len(candidates):
            # Only a replica the filter removed makes a spillover: when all are overloaded it
            # keeps them all, and a session then moves only by the scores (or stays).
            names = {c.name for c in kept}
            cycle.overloaded = frozenset(c.name for c in candidates if c.name not in names)
        return kept or candidates

    def _pin_goes(
        self,
        cycle: CycleState,
        pin: ReplicaState,
        candidates: Sequence[ReplicaState],
        holder: Callable[[ReplicaState], bool],
    ) -> bool:
        held = self.held_tokens(cycle, candidates)
        ranked = sorted(held.values())
        if held[pin.name] <= ranked[(len(ranked) - 1) // 2]:
            return True  # it holds no more than half of the candidates do: moving recomputes nothing
        # Where the turn could go: a replica that takes new work.
        others = [
            o
            for o in candidates
            if o is not pin and o.queue <= self.queue_threshold and (holder(o) or not self.overloaded(o))
        ]
        return self.spill_pays(cycle, pin, others, held)

    def why(self, state: ReplicaState) -> str:
        """Its KV usage or queue over the limits."""
        return (
            f"overloaded (kv usage {state.kv_usage:.2f}, limit {self.kv_threshold}, with "
            f"{self.waiting(state):.1f} requests waiting, limit {self.waiting_threshold:g}; "
            f"queue {state.queue}, limit {self.queue_threshold}; a session's pin only when its queue "
            f"costs more than recomputing what it holds elsewhere)"
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
