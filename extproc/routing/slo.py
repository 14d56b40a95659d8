"""Routing to a latency objective: the filter and scorer that use each candidate's predicted
latencies (:mod:`extproc.routing.latency`).

A request that carries objectives (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) is kept off the
candidates predicted to miss them (:class:`SloFilter`; if every warm candidate would miss, none
is removed), and among those left the one with the most headroom is preferred
(:class:`SloHeadroomScorer`, weighed lightly: a session's pin and a deep prefix match still
decide, headroom breaks what they leave tied; where all would miss, the least late one). A
replica whose model is not warm yet is neither removed nor preferred; with no warm model at all
both plugins change nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.request.features import RequestFeatures
from extproc.routing.latency import LoadPoint, Prediction, has_objectives, headroom
from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState


def _uncached(features: RequestFeatures, matched_blocks: int, block_tokens: int) -> int:
    tokens = features.estimated_prompt_tokens
    return max(0, tokens - matched_blocks * (features.tokens_per_block or block_tokens))


def predictions(cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, Prediction]:
    """Each candidate's prediction for this request, where its model is warm; computed once per
    decision (kept on the cycle state). Where the price picks (``cycle.price_ttft``), the TTFT is
    the price's for every candidate."""
    if cycle.predicted is not None:
        return cycle.predicted
    out: dict[str, Prediction] = {}
    view = cycle.latency
    if cycle.price_ttft is not None:
        # The price profile: every candidate's TTFT is the price's (from its learnt rates or its
        # pool's prior; not known on the built-in prior alone); its TPOT is still the fit's, where warm.
        matches = cycle.view.prefix_matches
        for c in candidates:
            fit = view.fits.get(c.name) if view is not None else None
            tpot = None
            if view is not None and fit is not None and fit.tpot_warm:
                point = LoadPoint.of(c, _uncached(cycle.features, matches.get(c.name, 0), view.block_tokens))
                tpot = fit.tpot_s(point)
            out[c.name] = Prediction(cycle.price_ttft(cycle, c), tpot)
    elif view is not None and view.fits:
        matches = cycle.view.prefix_matches
        for c in candidates:
            fit = view.fits.get(c.name)
            if fit is None or not (fit.ttft_warm or fit.tpot_warm):
                continue
            point = LoadPoint.of(c, _uncached(cycle.features, matches.get(c.name, 0), view.block_tokens))
            out[c.name] = Prediction(
                fit.ttft_s(point) if fit.ttft_warm else None, fit.tpot_s(point) if fit.tpot_warm else None
            )
    cycle.predicted = out
    return out


def best_headroom(cycle: CycleState, candidates: Sequence[ReplicaState]) -> float | None:
    """For a request with objectives, the most headroom (:func:`headroom`) any candidate is
    predicted to leave, when every candidate has a warm model for an objective asked for; None
    otherwise (a candidate without one might meet them: nothing is known of the best)."""
    features = cycle.features
    if not candidates or not has_objectives(features):
        return None
    predicted = predictions(cycle, candidates)
    best: float | None = None
    for c in candidates:
        p = predicted.get(c.name)
        h = headroom(features, p) if p is not None else None
        if h is None:
            return None
        best = h if best is None else max(best, h)
    return best


@dataclass(slots=True)
class SloFilter:
    """Drops the candidates predicted to miss the request's objectives (by more than ``slack``, a
    share of the objective), unless every candidate with a warm model would: then it keeps all
    and the headroom scorer prefers the least late. Requests without objectives, and replicas
    whose model is not warm, pass."""

    slack: float = 0.0
    name: str = "slo"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop candidates predicted to miss."""
        features = cycle.features
        if not has_objectives(features):
            return candidates
        predicted = predictions(cycle, candidates)
        if not predicted:
            return candidates

        def misses(c: ReplicaState) -> bool:
            p = predicted.get(c.name)
            h = headroom(features, p) if p is not None else None
            return h is not None and h < -self.slack

        kept = [c for c in candidates if not misses(c)]
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Predicted to miss (the trace's predictions say by how much)."""
        return "predicted to miss the request's latency objectives"


@dataclass(slots=True)
class SloHeadroomScorer:
    """For a request with objectives: its predicted headroom, the least share of its TTFT and TPOT
    objectives a candidate is predicted to leave unused, from 0 (late by the whole objective or
    more) through 0.5 (just meeting it) to 1 (done at once). A candidate whose model is not warm
    scores the mean of the warm ones; without any warm model, nothing."""

    name: str = "slo_headroom"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score each candidate's predicted headroom."""
        features = cycle.features
        if not has_objectives(features):
            return {}
        predicted = predictions(cycle, candidates)
        scores: dict[str, float] = {}
        for name, p in predicted.items():
            h = headroom(features, p)
            if h is not None:
                # Half way for just meeting them: a request every candidate would miss still goes
                # where it is least late.
                scores[name] = min(1.0, max(0.0, (1.0 + h) / 2.0))
        if not scores:
            return {}
        neutral = sum(scores.values()) / len(scores)
        return {c.name: scores.get(c.name, neutral) for c in candidates}
