"""The built-in scorers: session affinity, prefix match, load, prefill cost, the ring and tenant
headroom (the adapters' is in :mod:`extproc.routing.lora`). Each returns a score in [0, 1] per
candidate and never sees its weight (:class:`~extproc.routing.plugins.Scorer`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.routing.model import ReplicaState, working_set_overflow
from extproc.routing.plugins import CycleState


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
        return {pinned: max(self.floor, held_share(view.prefix_matches, pinned, total))}


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
        base = median_held(matches, candidates)
        if base >= total:
            return {}
        return {name: (min(n, total) - base) / (total - base) for name, n in matches.items() if n > base}


def held_share(matches: Mapping[str, int], name: str, total: int) -> float:
    """The share of the prompt's ``total`` blocks that ``name`` is believed to hold, in [0, 1]
    (0 for a prompt without blocks)."""
    return min(1.0, max(0.0, matches.get(name, 0) / total)) if total else 0.0


def median_held(matches: Mapping[str, int], candidates: Sequence[ReplicaState]) -> int:
    """The blocks of the prompt that at least half of the candidates hold (the lower median of
    their matches; 0 without candidates)."""
    if not candidates or not matches:
        return 0
    # statistics.median_low costs ~5 us here (its type checks), twice a decision.
    held = sorted([matches.get(c.name, 0) for c in candidates])
    return held[(len(held) - 1) // 2]


def relative(values: Mapping[str, float], floor: float) -> dict[str, float]:
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
        work = relative({c.name: float(c.work(self.tokens_per_request)) for c in candidates}, self.floor_tokens)
        recent = relative({c.name: c.recent_requests for c in candidates}, self.floor_requests)
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

    A new conversation (a session without a pin: keyed, or keyless and known by its messages, not
    one continuing a history the router does not remember, :attr:`RequestFeatures.opens_conversation`)
    is placed by its whole cost: the KV of their own that the conversations live on a replica hold
    there (:attr:`ReplicaState.live_session_tokens`: each turn's part not believed cached when it
    was sent) beyond the replica's share (the candidates' mean), times ``live_context_weight``.
    Those conversations come back with their next turns whatever else happens; their context is
    what this one's competes with for the replica's KV and queue. A conversation counts from the
    moment it is placed, so a burst of new conversations sees the ones placed just before it
    (counted only once they came back, a burst after any imbalance all went to the replica
    carrying less: six new sessions onto one of two vLLM engines). A keyed one counts in full; a
    keyless request opening a conversation may be a one-off, which leaves nothing to come, so it
    counts at the rate recent keyless openings came back (at least a quarter while its first turn
    runs, so that a first wave opening together spreads), in full once it comes back itself:
    counted in full for the whole minute, a hot prefix's single questions spread over replicas new
    to it (hot-prefix at rate x2: TTFT p99 0.053 -> 0.165 s); they never come back, so they count
    a quarter only while they run. A prefix the new conversation
    shares with them (a system prompt, an agent harness) saves its prefill once, on its first
    turn, whereas the conversations it joins are a load for its whole life; without this, that
    one-time saving drew every new conversation onto the replica that prefilled the prefix
    first, so it never reached the other replicas and never stopped telling them apart (agents
    through real Envoy: 27 of the first 28 agents on one replica, which then evicted and moved
    them). With it a replica holding a shared prefix takes new conversations until what it
    carries beyond its share outweighs the prefix's prefill; then the next one prefills the
    prefix elsewhere, once, and that replica holds it too. A prefix they share is counted once,
    by the conversation that brought it, so a burst of conversations with the same long prompt
    stays together; a fork, whose prompt is its parent's whole context, goes with its parent
    unless the parent's replica already carries more than that context beyond its share.

    ``session_tokens`` (0 by default) adds a fixed price per conversation live there beyond the
    share (by count, rounded up). Both only for a new conversation: a pinned one is part of that
    load already, and under KV pressure, where pins are lost, counting it moved conversations off
    their partial caches (multi-turn at 3,000 blocks: TTFT p99 0.28 -> 0.51 s).
    """

    floor_tokens: int = 2048
    kv_weight: float = 0.0
    overflow_weight: float = 0.0
    session_tokens: int = 0
    live_context_weight: float = 1.0
    """Tokens of cost per token of live conversations' own KV beyond the replica's share, for a
    new conversation (0: off)."""
    working_set_weight: float = 0.0
    """Tokens of cost, for a new conversation, per token its place is expected to make its own next
    turns and those of the conversations due back there recompute
    (:func:`~extproc.routing.model.working_set_overflow`; 0: off, the default). With 1 and
    ``live_context_weight`` 0, real vLLM at 36 conversations / 18 live found 34.3% against 30.0%
    over thirteen pairs, TTFT p99 0.48 s later (benchmarks/realstack-vllm.md); beside
    ``live_context_weight`` 1, which spreads conversations evenly whether or not their histories
    fit, it found no more than without it."""
    evict_weight: float = 1.0
    """For a prompt no candidate holds more of than the others: tokens of cost per uncached token,
    times how much more of them that replica's prefix cache has no room for than the candidate
    with most room (:func:`_beyond_room`): the cached prefixes they displace there, which later
    requests recompute. While caches fill, this is what places a new prefix where there is room
    for it: a replica's recent requests lag the prefixes it was given (vLLM's own client, 8
    shared prefixes on 3 real engines that hold 2-3 each: one engine was given three or four,
    83.4-87.1% in three runs without it; 89.2%, one prefill a prefix, in three with it). Where
    every cache is full, or every one has room, it adds nothing (0: off)."""
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
        new_conversation = f.opens_conversation and cycle.view.pinned is None
        per_session = self.session_tokens if new_conversation else 0
        share = math.ceil(sum(c.live_sessions for c in candidates) / len(candidates)) if per_session else 0
        per_token = self.live_context_weight if new_conversation else 0.0
        context_share = sum(c.live_session_tokens for c in candidates) / len(candidates) if per_token else 0.0
        cost = {}
        uncached = {c.name: tokens * (1.0 - held_share(matches, c.name, total)) for c in candidates}
        own = round(max(uncached.values())) if new_conversation and self.working_set_weight else 0
        # Only for a prompt whose match tells no candidate apart (new everywhere, or a system
        # prompt every candidate holds): where one holds more, that is where it lives, and a copy
        # elsewhere is the prefix and uncached terms' to weigh (charged there too, the simulator's
        # Mooncake conversations and shared prefixes at 12,000 blocks found 0.2 and 0.6 points less).
        beyond: dict[str, float] = {}
        if self.evict_weight and len({matches.get(c.name, 0) for c in candidates}) == 1:
            beyond = {c.name: _beyond_room(c, uncached[c.name]) for c in candidates}
        least = min(beyond.values(), default=0.0)
        for c in candidates:
            cost[c.name] = float(c.pending_prefill_tokens) + uncached[c.name]
            if beyond:
                cost[c.name] += self.evict_weight * uncached[c.name] * (beyond[c.name] - least)
            if own:
                cost[c.name] += self.working_set_weight * working_set_overflow(c, own)
            cost[c.name] += per_session * max(0, c.live_sessions - share)
            cost[c.name] += per_token * max(0.0, c.live_session_tokens - context_share)
            if self.kv_weight or self.overflow_weight:
                # KV held by running requests (what the router's requests in flight added, or what
                # the replica last reported if more): beyond the cache, this request queues until some finish,
                # and whatever it takes evicts other sessions' prefixes.
                held = max(float(c.inflight_tokens), min(1.0, max(0.0, c.kv_usage)) * c.kv_capacity_tokens)
                cost[c.name] += self.kv_weight * held
                if c.kv_capacity_tokens:
                    cost[c.name] += self.overflow_weight * max(0.0, held + tokens - c.kv_capacity_tokens)
        return relative(cost, float(self.floor_tokens))


def _beyond_room(state: ReplicaState, uncached: float) -> float:
    """The share of ``uncached`` tokens that ``state``'s prefix cache has no room for
    (:attr:`ReplicaState.cache_fill`), which it would take by displacing cached prefixes: all of
    them in a full cache or one of unknown size, none in a cache with room for them all."""
    if uncached <= 0:
        return 0.0
    room = (1.0 - min(1.0, max(0.0, state.cache_fill))) * state.kv_capacity_tokens
    return 1.0 - min(1.0, room / uncached)


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
