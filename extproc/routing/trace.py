"""What a decision can tell about itself: each filter's removals and why, each scorer's part.

:func:`extproc.routing.pipeline.decide` fills a :class:`DecisionTrace` only when given one (the
admin API's Explain); the request path passes none and pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.request.features import RequestFeatures
from extproc.routing.latency import Prediction
from extproc.routing.model import AffinityView, Decision, Snapshot
from extproc.routing.price_parts import Price


@dataclass(slots=True)
class FilterPass:
    """One filter's pass over the candidates."""

    filter: str
    removed: list[tuple[str, str]] = field(default_factory=list)
    """(replica, why) for each replica it removed."""
    failed_open: bool = False
    """It would have removed every candidate, so it kept them all."""


@dataclass(slots=True)
class ScorerPass:
    """One scorer's raw scores (clamped to [0, 1]) and the weight the profile gives it."""

    scorer: str
    weight: float
    raw: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class DecisionTrace:
    """The steps of one decision, in order."""

    profile: str = ""
    key_source: str = "none"
    filters: list[FilterPass] = field(default_factory=list)
    scorers: list[ScorerPass] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    """The picker's order, best first."""
    predicted: dict[str, Prediction] = field(default_factory=dict)
    """Per candidate whose latency model is warm: its predicted TTFT and TPOT for this request."""
    prices: dict[str, Price] = field(default_factory=dict)
    """Per candidate, where the profile prices them (:mod:`extproc.routing.price`): its predicted
    seconds and their parts."""

    def removed_by(self) -> dict[str, tuple[str, str]]:
        """replica -> (filter, why), for replicas some filter removed."""
        out: dict[str, tuple[str, str]] = {}
        for step in self.filters:
            for name, why in step.removed:
                out.setdefault(name, (step.filter, why))
        return out


@dataclass(frozen=True, slots=True)
class CacheEvidence:
    """How far one replica's cache picture can be believed, and how fresh it is."""

    trust: float
    """The share of the index's claims its hit counters bear out (1: no evidence against)."""
    evidence_age_s: float | None
    """Seconds since its counters last bore on the claims; None if they never did."""
    kv_events: str
    """Its KV-event feed: ``live``, ``silent`` (subscribed, not heard from lately) or ``""`` (none)."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """A decision computed for the admin API's Explain, with what went into it."""

    features: RequestFeatures
    decision: Decision
    trace: DecisionTrace
    view: AffinityView
    snapshot: Snapshot
    uncached_tokens: Mapping[str, int]
    """Per replica: prompt tokens it would have to prefill (the prompt minus its matched blocks)."""
    cordons: Mapping[str, str]
    match_sources: Mapping[str, str] = field(default_factory=dict)
    """Per replica with matches: "kv_events" (its engine's events), "estimate" (what was sent there) or
    "in_flight" (prompts of requests still running or queued there)."""
    evidence: Mapping[str, CacheEvidence] = field(default_factory=dict)
    """Per replica: the trust and freshness of what the caches are believed to hold."""
    on_miss: str = ""
    """Where every candidate is predicted to miss the objectives: what the request's class does
    then (``best_effort``, ``queue`` or ``shed``); empty otherwise."""
