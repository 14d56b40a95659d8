"""What a decision can tell about itself: each filter's removals and why, each scorer's part.

:func:`extproc.routing.pipeline.decide` fills a :class:`DecisionTrace` only when given one (the
admin API's Explain); the request path passes none and pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.request.features import RequestFeatures
from extproc.routing.model import AffinityView, Decision, ReplicaState, Snapshot


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

    def removed_by(self) -> dict[str, tuple[str, str]]:
        """replica -> (filter, why), for replicas some filter removed."""
        out: dict[str, tuple[str, str]] = {}
        for step in self.filters:
            for name, why in step.removed:
                out.setdefault(name, (step.filter, why))
        return out


def why_removed(filter_name: str, params: Mapping[str, object], state: ReplicaState) -> str:
    """A short reason a filter dropped ``state``, from what the filter and the state show.

    Filters only answer "who stays"; the explanation is derived here so plugins need no second
    method (one that offers ``why(state)`` is asked first, by the pipeline).
    """
    if filter_name == "in_rotation":
        return f"out of rotation (health {state.health:.2f})"
    if filter_name == "overload":
        kv_t, q_t = params.get("kv_threshold"), params.get("queue_threshold")
        return f"overloaded (kv usage {state.kv_usage:.2f}, limit {kv_t}; queue {state.queue}, limit {q_t})"
    if filter_name == "pool":
        return "outside the request's pool"
    if filter_name == "tenant_shard":
        return "outside the tenant's shard"
    if filter_name == "lora":
        return "does not serve the requested adapter"
    return f"removed by {filter_name}"


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
