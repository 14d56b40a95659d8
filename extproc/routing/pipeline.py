"""The decision: filters, then weighted scorers, then a picker. A pure function of its inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from extproc.request.features import FeatureSettings, RequestFeatures, uncached_tokens
from extproc.request.subset import in_subset
from extproc.routing.cordon import CordonFilter
from extproc.routing.disagg import Pair, PairInputs, PairSettings, choose_prefill
from extproc.routing.hot import fingerprint
from extproc.routing.latency import LatencyView
from extproc.routing.model import NO_TERMS, AffinityView, Decision, Reason, ReplicaState, Snapshot, TenantTerms
from extproc.routing.plugins import CycleState, Filter
from extproc.routing.price import PricePicker, predicted_ttft_s, prefill_here_s
from extproc.routing.profile import KeySource, Profile, Profiles
from extproc.routing.roles import PairReason, Role
from extproc.routing.slo import best_headroom, predictions
from extproc.routing.trace import DecisionTrace, FilterPass, ScorerPass

# Profile and Profiles live in extproc.routing.profile; the router and the lab import them from here too.
__all__ = [
    "PRICE_STEP",
    "ROLE_STEP",
    "STORED_STEP",
    "SUBSET_STEP",
    "Decider",
    "DecisionInputs",
    "Profile",
    "Profiles",
    "decide",
    "ranked_decision",
]


def _clamp(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


SUBSET_STEP = "subset"
STORED_STEP = "stored_conversation"
"""The step that keeps a turn whose conversation only its pinned engine stores on that engine."""
"""The step that keeps only the endpoints the gateway offers (its subset hint), in the trace and as
``Decision.moved_by``."""
ROLE_STEP = "role"
"""The step that keeps only replicas that decode, where replicas carry roles (in the trace and as
``Decision.moved_by``)."""
PRICE_STEP = "price"
"""What moved a session off its pinned replica when the price did (``Decision.moved_by``)."""
_PAIRING = PairSettings()
_BLOCK_CHARS = FeatureSettings().block_chars


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """Everything one decision reads, as the router assembled it.

    ``snapshot`` is the replicas' health and load as last known, ``view`` what the caches are
    believed to hold for this request (the store's pin and prefix index, weighed by the replicas'
    own reports), ``now`` the clock's value, ``tenant`` the terms of the request's tenant (quota,
    shard), ``cordons`` the replicas an operator cordoned or drained (:mod:`extproc.routing.cordon`),
    ``hot`` the hot prefixes' fingerprints and how many replicas each should have
    (:mod:`extproc.routing.hot`), ``prefix_key`` the request's prefix ring key as the profile
    computes it (:meth:`Profile.prefix_key`; computed once per request by the router), ``latency``
    the replicas' latency models (:mod:`extproc.routing.latency`), ``pairing`` how a disaggregated
    pair is weighed where the candidates carry roles (:mod:`extproc.routing.disagg`), and
    ``block_chars`` the characters of a prefix block (what a match is worth in tokens without a
    tokenizer).
    """

    features: RequestFeatures
    snapshot: Snapshot
    view: AffinityView
    now: float
    profile: Profile
    tenant: TenantTerms = NO_TERMS
    cordons: Mapping[str, str] | None = None
    hot: Mapping[int, int] | None = None
    prefix_key: str | int | None = None
    latency: LatencyView | None = None
    pairing: PairSettings = _PAIRING
    block_chars: int = _BLOCK_CHARS
    prefix_fingerprint: int | None = None
    """``prefix_key``'s fingerprint where the router computed it (hot keys on); else computed here."""
    record: bool = True
    """Whether the decision is carried out: False for Explain and for a held request's re-judgement,
    which must leave what a picker keeps of its own choices as it is."""

    @classmethod
    def of(
        cls,
        features: RequestFeatures,
        snapshot: Snapshot,
        view: AffinityView,
        now: float,
        profile: Profile,
        tenant: TenantTerms = NO_TERMS,
        *,
        cordons: Mapping[str, str] | None = None,
        hot: Mapping[int, int] | None = None,
        latency: LatencyView | None = None,
        pairing: PairSettings | None = None,
        block_chars: int | None = None,
    ) -> DecisionInputs:
        """The inputs with the prefix key computed from ``profile``."""
        return cls(
            features,
            snapshot,
            view,
            now,
            profile,
            tenant,
            cordons,
            hot,
            profile.prefix_key(features),
            latency,
            pairing if pairing is not None else _PAIRING,
            block_chars if block_chars is not None else _BLOCK_CHARS,
        )


def decide(given: DecisionInputs, trace: DecisionTrace | None = None) -> Decision:
    """Choose a replica for a request. Nothing here performs I/O. Given a ``trace``, the decision
    records its steps there (the admin API's Explain)."""
    features, snapshot, view, profile, tenant = given.features, given.snapshot, given.view, given.profile, given.tenant
    # Admission: a tenant over its quota is refused, or confined to the overflow pool.
    if tenant.over_quota:
        if tenant.over_quota_action == "reject":
            return Decision(replica=None, reason=Reason.QUOTA, pin=False, retry_after_s=tenant.retry_after_s)
        features = replace(features, pool=tenant.overflow_pool)
    if not snapshot.replicas:
        return Decision(replica=None, reason=Reason.NO_REPLICA)
    ring_key, key_source = profile.ring_key(features, given.prefix_key)
    cycle = CycleState(
        features=features,
        snapshot=snapshot,
        view=view,
        now=given.now,
        ring=profile.ring_for(snapshot),
        ring_key=ring_key,
        key_source=key_source,
        tenant=tenant,
        latency=given.latency,
        block_chars=given.block_chars,
        record=given.record,
    )
    picker = profile.picker
    if isinstance(picker, PricePicker):
        cycle.price_ttft = lambda c, state: predicted_ttft_s(c, state, picker)
    if given.hot:
        cycle.hot_key = given.prefix_key
        if cycle.hot_key is not None:
            fp = given.prefix_fingerprint
            cycle.hot_replicas = given.hot.get(fingerprint(cycle.hot_key) if fp is None else fp, 0)
    candidates: list[ReplicaState] = list(snapshot.replicas)
    if trace is not None:
        trace.profile, trace.key_source = profile.name, key_source
    pinned = view.pinned
    moved_by = ""
    if features.subset is not None:
        # The gateway's word on where this request may go: before everything, and no failing
        # open (none offered is a 503, as the endpoint-picker protocol says).
        candidates = _offered(candidates, features.subset, trace)
        if not candidates:
            return Decision(replica=None, reason=Reason.NO_REPLICA)
        if pinned is not None and all(c.name != pinned for c in candidates):
            moved_by = SUBSET_STEP
    cordons = given.cordons
    if cordons:
        # Before the profile's filters, whatever the profile: a cordon is the operator's word.
        cordon = CordonFilter(cordons, pin_lost=view.pin_lost is not None)
        kept = [c for c in candidates if cordon.keeps(c, view.pinned)]
        if trace is not None:
            step = FilterPass(cordon.name, failed_open=not kept)
            step.removed = [(c.name, cordon.why(c)) for c in candidates if not cordon.keeps(c, view.pinned)]
            trace.filters.append(step)
        candidates = kept or candidates
    if pinned is not None and not moved_by and all(c.name != pinned for c in candidates):
        moved_by = "cordon" if any(s.name == pinned for s in snapshot.replicas) else "membership"
    chain = features.conversation
    if chain is not None and chain.stored and chain.match == "continued" and pinned is not None:
        # Only the pinned engine holds this conversation (vLLM's Responses store is in its own
        # memory): anywhere else the turn is a 404, so no load or price moves it while it is here.
        kept = [c for c in candidates if c.name == pinned and c.in_rotation]  # a failed engine fails over
        if kept and trace is not None:
            step = FilterPass(STORED_STEP)
            step.removed = [(c.name, "does not store the conversation") for c in candidates if c.name != pinned]
            trace.filters.append(step)
        candidates = kept or candidates
    for flt in profile.filters:
        candidates = flt.filter(cycle, candidates) if trace is None else _traced_filter(flt, cycle, candidates, trace)
        if pinned is not None and not moved_by and all(c.name != pinned for c in candidates):
            moved_by = flt.name
    # Where replicas carry roles, the decode replica is the pipeline's pick among those that
    # decode (a prefill-only replica never serves the request itself); the prefill hop is weighed
    # after, over all the candidates (:func:`_pair`). A fleet without roles skips all of this.
    everyone = candidates
    paired = any(c.role is not Role.BOTH for c in candidates)
    if paired:
        decoders = [c for c in candidates if c.role.decodes]
        if trace is not None:
            step = FilterPass(ROLE_STEP)
            step.removed = [(c.name, "prefill only (llm-d.ai/role)") for c in candidates if not c.role.decodes]
            trace.filters.append(step)
        candidates = decoders
        if pinned is not None and not moved_by and all(c.name != pinned for c in candidates):
            moved_by = ROLE_STEP
        if not candidates:
            return Decision(replica=None, reason=Reason.NO_REPLICA, pair=PairReason.NO_DECODER, moved_by=moved_by)
    totals: dict[str, float] = {c.name: 0.0 for c in candidates}
    for weighted in profile.scorers:
        scores = weighted.scorer.score(cycle, candidates)
        if trace is not None:
            trace.scorers.append(
                ScorerPass(
                    weighted.scorer.name, weighted.weight, {n: _clamp(v) for n, v in scores.items() if n in totals}
                )
            )
        for name, score in scores.items():
            if name in totals:
                totals[name] += weighted.weight * _clamp(score)
    ordered = profile.picker.pick(cycle, candidates, totals)
    if trace is not None:
        trace.totals = dict(totals)
        trace.order = [s.name for s in ordered]
        trace.predicted = dict(predictions(cycle, candidates))
        trace.prices = dict(cycle.prices or {})
    if pinned is not None and not moved_by and cycle.prices is not None and ordered[0].name != pinned:
        # The pin was a candidate and the price left it: waiting there cost more than moving.
        moved_by = PRICE_STEP
    hot_set = tuple(sorted(cycle.hot_set or ()))
    pair = _pair(given, cycle, everyone, ordered[0]) if paired else None
    decision = _conclude(
        features, view, profile, ordered, totals, key_source, cycle.overloaded, hot_set, moved_by, pair
    )
    best = best_headroom(cycle, candidates)
    if best is not None:
        decision = replace(decision, objective_headroom=best, objective_missed=best < 0.0)
    return decision


def _offered(candidates: list[ReplicaState], subset: frozenset[str], trace: DecisionTrace | None) -> list[ReplicaState]:
    """The candidates among the endpoints the gateway offers (the subset hint)."""
    kept = [c for c in candidates if in_subset(c.replica.address, subset)]
    if trace is not None:
        names = {c.name for c in kept}
        step = FilterPass(SUBSET_STEP)
        step.removed = [(c.name, "not offered by the gateway (subset hint)") for c in candidates if c.name not in names]
        trace.filters.append(step)
    return kept


def _pair(given: DecisionInputs, cycle: CycleState, candidates: Sequence[ReplicaState], decode: ReplicaState) -> Pair:
    """The prefill hop for ``decode``, if one repays itself (:func:`choose_prefill`): what each
    candidate holds of the prompt is its matched blocks in tokens, as the bookkeeping counts it.
    Where the price picks, the hop is weighed in its seconds (:func:`prefill_here_s`)."""
    features = cycle.features
    prompt = features.estimated_prompt_tokens
    matches = given.view.prefix_matches
    cached = {c.name: prompt - uncached_tokens(features, matches.get(c.name, 0), given.block_chars) for c in candidates}
    picker = given.profile.picker
    inputs = PairInputs(candidates, prompt, cached, given.view.pinned)
    if not isinstance(picker, PricePicker):
        return choose_prefill(inputs, decode, given.pairing)
    price = picker

    def cost(state: ReplicaState) -> float:
        return prefill_here_s(cycle, state, price)

    return choose_prefill(inputs, decode, given.pairing, cost=cost)


class Decider(Protocol):
    """The decision step the router calls: :func:`decide`, or a stand-in with its signature
    (the lab's simulated peer routers, which choose by their own rules)."""

    def __call__(self, given: DecisionInputs, trace: DecisionTrace | None = None) -> Decision:
        """Choose a replica for a request (see :func:`decide`)."""
        ...


def ranked_decision(
    features: RequestFeatures,
    view: AffinityView,
    profile: Profile,
    ordered: Sequence[ReplicaState],
    totals: Mapping[str, float] | None = None,
) -> Decision:
    """The decision for replicas ranked outside the pipeline (``ordered``, the choice first):
    reason, pin, fallbacks and matched blocks as :func:`decide` states them, no replica having
    been judged overloaded."""
    if not ordered:
        return Decision(replica=None, reason=Reason.NO_REPLICA)
    _, key_source = profile.ring_key(features, profile.prefix_key(features))
    scores = dict(totals) if totals is not None else {s.name: 0.0 for s in ordered}
    return _conclude(features, view, profile, ordered, scores, key_source, frozenset())


def _conclude(
    features: RequestFeatures,
    view: AffinityView,
    profile: Profile,
    ordered: Sequence[ReplicaState],
    totals: Mapping[str, float],
    key_source: KeySource,
    overloaded: frozenset[str],
    hot_set: tuple[str, ...] = (),
    moved_by: str = "",
    pair: Pair | None = None,
) -> Decision:
    chosen = ordered[0]
    matched = view.prefix_matches.get(chosen.name, 0)
    reason = _reason(view, key_source, overloaded, chosen, matched, totals)
    if view.pinned is None or chosen.name == view.pinned:
        moved_by = ""
    elif not moved_by:
        moved_by = view.pin_lost or "scores"
    priced_out = moved_by == PRICE_STEP
    if priced_out:
        # Staying cost more than recomputing the history elsewhere: a spillover, and the session
        # follows its history (re-pinned there, where its next turns are cached).
        reason = Reason.SPILLOVER
    # A spilled session keeps its pin (it returns once the replica cools down) only where the pin
    # still holds its conversation: a session without a pin, or whose pin lost it, follows the
    # history this turn builds where it went.
    follows = view.pinned is None or view.pin_lost is not None
    return Decision(
        replica=chosen.replica,
        reason=reason,
        pin=reason is not Reason.SPILLOVER or follows or profile.repin_on_spillover or priced_out,
        fallbacks=tuple(s.replica for s in ordered[1 : 1 + profile.max_fallbacks]),
        matched_blocks=matched,
        total_blocks=len(features.prefix_hashes),
        scores=totals,
        hot_set=hot_set,
        moved_by=moved_by,
        prefill=pair.prefill.replica if pair is not None and pair.prefill is not None else None,
        pair=pair.reason if pair is not None else None,
        transfer_blocks=pair.transfer_blocks if pair is not None else 0,
    )


def _traced_filter(
    flt: Filter, cycle: CycleState, candidates: list[ReplicaState], trace: DecisionTrace
) -> list[ReplicaState]:
    kept = flt.filter(cycle, candidates)
    names = {c.name for c in kept}
    step = FilterPass(flt.name)
    step.removed = [(c.name, flt.why(c)) for c in candidates if c.name not in names]
    trace.filters.append(step)
    return kept


def _reason(
    view: AffinityView,
    key_source: KeySource,
    overloaded: frozenset[str],
    chosen: ReplicaState,
    matched: int,
    totals: Mapping[str, float],
) -> Reason:
    if view.pinned:
        if chosen.name == view.pinned:
            return Reason.STICKY
        if view.pinned in overloaded:
            return Reason.SPILLOVER
        return Reason.EVICTED if view.pin_lost and view.pinned in totals else Reason.FAILOVER
    if view.prefix_matches:
        best = max(view.prefix_matches.items(), key=lambda kv: kv[1])[0]
        if best in overloaded and best != chosen.name:
            return Reason.SPILLOVER
    if matched > 0:
        return Reason.PREFIX
    if key_source in ("session", "prefix"):
        return Reason.NEW_SESSION
    return Reason.FALLBACK
