"""The pipeline's extension points and the built-in plugins.

Filters drop candidates; scorers return a score in [0, 1] per candidate and never see their
weight (the profile weighs them); one picker orders the weighted results. Plugins only read:
what a decision changes (pins, the prefix index, in-flight counts) is recorded afterwards by
the router.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.request.features import RequestFeatures, uncached_tokens
from extproc.routing.latency import LatencyView, Prediction
from extproc.routing.model import NO_TERMS, AffinityView, ReplicaState, Snapshot, TenantTerms
from extproc.routing.price_parts import Price
from extproc.routing.ring import HashRing

_BLOCK_CHARS = 64
"""The characters of a prefix block by default (``features.block_chars``)."""


@dataclass(slots=True)
class CycleState:
    """Everything one decision reads, and what its filters found that later steps use."""

    features: RequestFeatures
    snapshot: Snapshot
    view: AffinityView
    now: float
    ring: HashRing
    ring_key: str | int | None
    key_source: str = "none"
    tenant: TenantTerms = NO_TERMS
    hot_key: str | int | None = None
    """The request's prefix ring key (without the session), which hot prefixes are known by."""
    hot_replicas: int = 0
    """Replicas its prefix should be served by when it is hot (:mod:`extproc.routing.hot`); 0: not hot."""
    overloaded: frozenset[str] = frozenset()
    """Replicas the overload filter dropped: a pinned or best-matching one dropped there makes the
    decision a spillover."""
    hot_set: frozenset[str] | None = None
    """A hot prefix's replica set, as the hot-prefix filter chose it (None: not hot, or a session
    pinned elsewhere kept its replica)."""
    latency: LatencyView | None = None
    """The replicas' latency models (:mod:`extproc.routing.latency`); None: none kept."""
    predicted: dict[str, Prediction] | None = None
    """Candidates' predicted latencies for this request, once the latency plugins computed them."""
    block_chars: int = _BLOCK_CHARS
    """The characters of a prefix block (what a match is worth in tokens without a tokenizer)."""
    prices: dict[str, Price] | None = None
    """Candidates' prices for this request (:mod:`extproc.routing.price`), once computed."""
    price_ttft: Callable[[CycleState, ReplicaState], float] | None = None
    """The price's predicted time to first token of this request on a replica, where the profile's
    picker is the price: the latency objectives and the prefill hop judge by it then (one
    prediction for every choice), not by their own estimates."""


class Filter(Protocol):
    """Drops candidates that must not receive this request, and says why (the decision trace)."""

    name: str

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """The candidates that remain."""
        ...

    def why(self, state: ReplicaState) -> str:
        """Why ``state`` was removed (asked only for removed replicas, only when tracing)."""
        ...


class Scorer(Protocol):
    """Ranks candidates; every score lies in [0, 1]."""

    name: str

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """A score per candidate name (missing names score 0)."""
        ...


class Picker(Protocol):
    """Orders the candidates by their weighted totals: the first is the choice, the rest fallbacks."""

    name: str

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates, best first."""
        ...

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet: nothing the picker kept about it holds."""
        ...


# --- filters ------------------------------------------------------------------------------------


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


def _adapter_requested(model: str, candidates: Sequence[ReplicaState]) -> bool:
    """Whether ``model`` names a LoRA adapter: listed by some replica (loaded or waiting), or asked
    of a fleet that serves adapters while no replica serves it as a base model."""
    if not model or not any(c.max_lora for c in candidates):
        return False
    if any(model in c.adapters or model in c.adapters_waiting for c in candidates):
        return True
    bases = [c.models for c in candidates if c.models]
    return bool(bases) and not any(model in b for b in bases)


@dataclass(slots=True)
class LoraFilter:
    """For a known LoRA adapter, drops replicas whose adapter slots (``max_lora``) are all taken by
    other adapters: sending it there would force an adapter swap. Keeps all if every one is full."""

    name: str = "lora"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas that cannot take the adapter without evicting another."""
        model = cycle.features.model
        if not _adapter_requested(model, candidates):
            return candidates
        kept = [
            c
            for c in candidates
            if model in c.adapters or model in c.adapters_waiting or not c.max_lora or len(c.adapters) < c.max_lora
        ]
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Its adapter slots are taken."""
        return "does not serve the requested adapter"


# --- scorers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class SessionAffinityScorer:
    """1 for the replica the session is pinned to, 0 elsewhere.

    With ``by_cache`` (the default), a pin whose cache is known lost (``AffinityView.pin_lost``:
    the replica's own events say so, or its counters, by misses or by bearing out the index's
    eviction) is worth what the replica is still believed
    to hold of the prompt, at least ``floor``. Without such evidence the pin keeps its full
    value: a counter that does not move, a page without prefix metrics or an index that forgot
    the prompt say nothing about the replica's cache, and the session stays where its KV cache
    is. Even when the cache is gone, moving has a price: the conversation's next turns rebuild
    its blocks wherever it lands, and a hop leaves copies behind in caches that are already full
    (on real vLLM engines under KV pressure, sessions moved off evicted pins gave 40-60% hit
    ratio against a plain session hash's 64-74%). ``floor`` is that price: another replica
    takes the session only when what it holds of this conversation and its load outweigh it.
    """

    by_cache: bool = True
    floor: float = 0.15
    """The least a pin is worth whose cache is known lost. At the default weight (10) that is 1.5
    points: a session rides out small load differences, but not a clearly busier replica (the
    load scorer gives up to 2) nor a replica holding most of this conversation (the prefix scorer
    gives up to 2 for what tells it apart)."""
    name: str = "session_affinity"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score the pinned replica."""
        view = cycle.view
        pinned = view.pinned
        if not pinned:
            return {}
        total = len(cycle.features.prefix_hashes)
        if not self.by_cache or not total or view.pin_lost is None:
            return {pinned: 1.0}
        return {pinned: max(self.floor, _held(view.prefix_matches, pinned, total))}


@dataclass(slots=True)
class PrefixScorer:
    """How much of the request's prefix a replica is believed to hold, beyond what every
    candidate holds.

    Scoring by fraction (as GIE does) rather than by a first-block match, and only on the part
    that tells candidates apart, keeps a prefix that every request shares (a common system
    prompt, cached everywhere) from pulling new sessions towards the replicas that already have
    the most of them.
    """

    name: str = "prefix"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """(matched - median matched) / (total - median matched), per candidate above the median."""
        total = len(cycle.features.prefix_hashes)
        matches = cycle.view.prefix_matches
        if not total or not matches:
            return {}
        # What at least half of the candidates hold does not tell them apart (a system prompt every
        # replica that ever served has); the minimum would let one cold replica make it count, and
        # that replica would then never be chosen.
        base = _median_held(matches, candidates)
        if base >= total:
            return {}
        return {name: (min(n, total) - base) / (total - base) for name, n in matches.items() if n > base}


def _held(matches: Mapping[str, int], name: str, total: int) -> float:
    """The share of the prompt's ``total`` blocks that ``name`` is believed to hold, in [0, 1]
    (0 for a prompt without blocks)."""
    return min(1.0, max(0.0, matches.get(name, 0) / total)) if total else 0.0


def _median_held(matches: Mapping[str, int], candidates: Sequence[ReplicaState]) -> int:
    """The blocks of the prompt that at least half of the candidates hold (the lower median of
    their matches; 0 without candidates)."""
    if not candidates or not matches:
        return 0
    # statistics.median_low costs ~5 us here (its type checks), twice a decision.
    held = sorted([matches.get(c.name, 0) for c in candidates])
    return held[(len(held) - 1) // 2]


def _relative(values: Mapping[str, float], floor: float) -> dict[str, float]:
    """1 for the lightest, falling linearly with the distance from it, scaled by the heaviest
    (never by less than ``floor``, so near-idle replicas score alike)."""
    lo = min(values.values(), default=0.0)
    scale = max(max(values.values(), default=0.0), floor)
    if scale <= 0:  # a floor of 0 and nothing anywhere: all alike
        return dict.fromkeys(values, 1.0)
    return {name: 1.0 - (v - lo) / scale for name, v in values.items()}


@dataclass(slots=True)
class LoadScorer:
    """Lighter is better, on three signals:

    - outstanding work the gateway sent: prefill tokens not yet answered, plus a decode cost per
      request in flight or queued (reacts within one request, so a burst does not herd);
    - recent requests, decayed over a minute (in a sticky fleet a replica's future load is the
      sessions pinned to it, which in-flight counts between turns do not show);
    - free KV cache, as last scraped.
    """

    work_weight: float = 0.3
    recent_weight: float = 0.5
    kv_weight: float = 0.2
    tokens_per_request: int = 256
    floor_tokens: int = 1024
    floor_requests: float = 1.0
    name: str = "load"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score each candidate's headroom."""
        work = _relative({c.name: float(c.work(self.tokens_per_request)) for c in candidates}, self.floor_tokens)
        recent = _relative({c.name: c.recent_requests for c in candidates}, self.floor_requests)
        total = self.work_weight + self.recent_weight + self.kv_weight or 1.0
        out = {}
        for c in candidates:
            free_kv = 1.0 - min(1.0, max(0.0, c.kv_usage))
            blended = self.work_weight * work[c.name] + self.recent_weight * recent[c.name] + self.kv_weight * free_kv
            out[c.name] = blended / total
        return out


@dataclass(slots=True)
class PrefillCostScorer:
    """Expected prefill work if the request went there, in tokens: what the replica still has to
    prefill for requests already sent, plus this prompt's part it does not hold. Cheaper is better.

    This weighs a prefix match against the queue it sits behind in the same unit: a shared system
    prompt held by one replica attracts new sessions only until the work piling up there costs
    more than prefilling the prompt elsewhere, which is what stops a burst from herding.

    A new conversation is placed by its whole cost: ``session_tokens`` for each conversation live
    there (:attr:`ReplicaState.live_sessions`: its stream running, its next turn to come) beyond
    the replica's share (the candidates' mean, rounded up), the decode load already pinned to it.
    Without it a prefix every conversation shares keeps drawing new ones onto the replicas that
    prefilled it first, however many conversations they already carry (a 2,000-token system
    prompt in the simulator: 3 of 8 replicas took all 96 conversations). Only for a new
    conversation (a session without a pin): a pinned one is part of that load already, and under
    KV pressure, where pins are lost, counting it moved conversations off their partial caches
    (multi-turn at 3,000 blocks: TTFT p99 0.28 -> 0.51 s).

    Off by default (0; 512 is what benchmarks/latency_objectives.md measured): it spreads the
    conversations of a shared prompt, but their first turns then prefill that prompt on replicas
    new to it (shared-system-chat: TTFT p50 0.040 -> 0.027 s, p99 0.076 -> 0.236 s), and a burst
    KV events would keep together is split.
    """

    floor_tokens: int = 2048
    kv_weight: float = 0.0
    overflow_weight: float = 0.0
    session_tokens: int = 0
    name: str = "prefill_cost"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """1 for the cheapest candidate, falling linearly with the extra expected work."""
        f = cycle.features
        total = len(f.prefix_hashes)
        tokens = f.estimated_prompt_tokens
        if not candidates:
            return {}
        matches = cycle.view.prefix_matches
        # Only a new conversation joins a replica's pinned load (a pinned one is already part of
        # it), and a replica pays only for the conversations it carries beyond its share.
        per_session = self.session_tokens if f.session_key and cycle.view.pinned is None else 0
        share = math.ceil(sum(c.live_sessions for c in candidates) / len(candidates)) if per_session else 0
        cost = {}
        for c in candidates:
            cost[c.name] = float(c.pending_prefill_tokens) + tokens * (1.0 - _held(matches, c.name, total))
            cost[c.name] += per_session * max(0, c.live_sessions - share)
            if self.kv_weight or self.overflow_weight:
                # KV held by running requests (what the router's requests in flight added, or what
                # the replica last reported if more): beyond the cache, this request queues until some finish,
                # and whatever it takes evicts other sessions' prefixes.
                held = max(float(c.inflight_tokens), min(1.0, max(0.0, c.kv_usage)) * c.kv_capacity_tokens)
                cost[c.name] += self.kv_weight * held
                if c.kv_capacity_tokens:
                    cost[c.name] += self.overflow_weight * max(0.0, held + tokens - c.kv_capacity_tokens)
        return _relative(cost, float(self.floor_tokens))


@dataclass(slots=True)
class RingScorer:
    """1 for the first replica on the consistent-hash ring from the request's key that is under
    the load bound ("consistent hashing with bounded loads"), 0 elsewhere.

    The bound is ``ceil(load_factor * (total in-flight + 1) / candidates)``: a replica already at
    it is passed over, so one hot key cannot pile more than its share onto one replica.
    """

    load_factor: float = 1.25
    name: str = "ring"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score the bounded ring owner of the request's key."""
        if cycle.ring_key is None or not candidates:
            return {}
        by_name = {c.name: c for c in candidates}
        total = sum(c.inflight for c in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        order = [n for n in cycle.ring.preference(cycle.ring_key) if n in by_name]
        owner = cycle.ring.bounded_owner(cycle.ring_key, lambda n: by_name[n].inflight + 1 <= bound, order)
        if owner is None:
            owner = order[0] if order else None
        return {owner: 1.0} if owner else {}


@dataclass(slots=True)
class TenantHeadroomScorer:
    """Prefers replicas where the request's tenant has few requests in flight, so one tenant's
    burst spreads instead of filling the replicas its sessions happen to live on."""

    per_replica: int = 16
    name: str = "tenant_headroom"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """1 with no requests of this tenant in flight there, 0 at ``per_replica``."""
        tenant = cycle.features.tenant
        load = cycle.snapshot.tenant_inflight
        if not tenant or not load:
            return {}
        cap = max(1, self.per_replica)
        return {c.name: 1.0 - min(1.0, load.get((tenant, c.name), 0) / cap) for c in candidates}


@dataclass(slots=True)
class LoraScorer:
    """For a LoRA adapter (the requested model name, as replicas list it in
    ``vllm:lora_requests_info``): loaded beats waiting beats a free adapter slot beats a full one,
    so an adapter is loaded once and reused, and ``max_lora`` is respected where possible."""

    name: str = "lora"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score each candidate's readiness for the adapter."""
        model = cycle.features.model
        if not _adapter_requested(model, candidates):
            return {}
        out = {}
        for c in candidates:
            if model in c.adapters:
                out[c.name] = 1.0
            elif model in c.adapters_waiting:
                out[c.name] = 0.6
            elif c.max_lora and len(c.adapters) < c.max_lora:
                out[c.name] = 0.3
            else:
                out[c.name] = 0.0
        return out


# --- pickers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RoundRobinPicker:
    """Every candidate in turn, by name, whatever the scores: a baseline that ignores the cache, to
    compare the share of the offered reuse it captures (``extproc admin hit-ratio``) with the
    scoring profile's. Each pick advances it, Explain's too."""

    name: str = field(default="in_turn", init=False)
    _turn: int = field(default=0, init=False, repr=False)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates from the next one in turn."""
        ordered = sorted(candidates, key=lambda c: c.name)
        if not ordered:
            return ordered
        start = self._turn % len(ordered)
        self._turn += 1
        return ordered[start:] + ordered[:start]

    def forget(self, replica: str) -> None:
        """Nothing kept per replica."""


@dataclass(slots=True)
class MaxScorePicker:
    """Highest total first; ties go to the lighter replica, then to the name (deterministic)."""

    name: str = "max_score"

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Order candidates best first."""
        return sorted(candidates, key=lambda c: (-totals.get(c.name, 0.0), c.work(256), c.name))

    def forget(self, replica: str) -> None:
        """Nothing kept per replica."""
