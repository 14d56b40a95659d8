"""Each replica's predicted time to first token (TTFT) and time per output token (TPOT), and what
a prediction says of a request's latency objectives (:func:`headroom`, :func:`verdict`).

The predictions come from a linear model per replica that the router fits online from what it
observes (:mod:`extproc.fleet.health.latency`); here it is only evaluated. Its inputs are what the
decision already knows of a candidate (:class:`LoadPoint`): the prompt tokens it would prefill
(the prompt less what it is believed to hold), the prefill work already sent there and not yet
answered, its running requests and its KV usage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.base.engine_rates import PoolRates
from extproc.request.features import RequestFeatures
from extproc.routing.model import ReplicaState

MIN_SECONDS = 1e-4
"""The least a prediction says: a fit extrapolated below zero means "about nothing"."""


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """What a replica's latency is predicted from, for one request there."""

    uncached_tokens: float
    """The prompt's tokens the replica would prefill (not believed held there)."""
    queued_prefill_tokens: float
    """Prefill tokens already sent there and not yet answered."""
    running: float
    """Requests running or waiting there (the router's count in flight, or the scrape's if more)."""
    kv_usage: float

    @classmethod
    def of(cls, state: ReplicaState, uncached_tokens: float) -> LoadPoint:
        """The point of ``state`` (as the snapshot has it) for a prompt of ``uncached_tokens``."""
        return cls(
            float(max(0.0, uncached_tokens)),
            float(state.pending_prefill_tokens),
            float(max(state.inflight, state.running + state.queue)),
            min(1.0, max(0.0, state.kv_usage)),
        )

    def ttft_terms(self) -> tuple[float, ...]:
        """The TTFT model's regressors: a constant, the prompt's and the queue's prefill (in
        thousands of tokens), the batch (in sixteens) and KV usage; the prompt's square (attention
        over its own context) and the prefill times the batch (each prefill step also decodes the
        running requests)."""
        u, q, r = self.uncached_tokens / 1000.0, self.queued_prefill_tokens / 1000.0, self.running / 16.0
        return (1.0, u, q, r, self.kv_usage, u * u, (u + q) * r)

    def tpot_terms(self) -> tuple[float, ...]:
        """The TPOT model's regressors: a constant, the batch, KV usage (the context each step
        reads) and the queued prefill (prefill steps interleave with the decode)."""
        return (1.0, self.running / 16.0, self.kv_usage, self.queued_prefill_tokens / 1000.0)


TTFT_TERMS = len(LoadPoint(0, 0, 0, 0).ttft_terms())
TPOT_TERMS = len(LoadPoint(0, 0, 0, 0).tpot_terms())


def _dot(coefficients: Sequence[float], terms: Sequence[float]) -> float:
    return max(MIN_SECONDS, sum(a * x for a, x in zip(coefficients, terms, strict=True)))


@dataclass(frozen=True, slots=True)
class LatencyFit:
    """One replica's latency model as last fitted: coefficients over :class:`LoadPoint`'s terms,
    how many observations shaped them, and how far its recent predictions were off."""

    ttft: tuple[float, ...]
    tpot: tuple[float, ...]
    ttft_samples: int = 0
    tpot_samples: int = 0
    ttft_error: float | None = None
    """The median relative error of its recent TTFT predictions (made before each observation)."""
    tpot_error: float | None = None
    ttft_warm: bool = False
    """Enough observations that its TTFT predictions are used."""
    tpot_warm: bool = False

    def ttft_s(self, point: LoadPoint) -> float:
        """Predicted seconds to the first token."""
        return _dot(self.ttft, point.ttft_terms())

    def tpot_s(self, point: LoadPoint) -> float:
        """Predicted seconds per output token after the first."""
        return _dot(self.tpot, point.tpot_terms())


@dataclass(frozen=True, slots=True)
class LearnedRates:
    """A replica's rates as learned from what its engine reported (None: not known yet): prompt
    tokens prefilled a second (cold), the seconds of a decode step of one sequence, and what
    each further sequence in the batch adds to a step. The price (:mod:`extproc.routing.price`)
    falls back to its prior for each rate missing here."""

    prefill_tokens_per_s: float | None = None
    decode_s_per_token: float | None = None
    decode_s_per_seq: float | None = None
    overhead_s: float | None = None
    """The seconds of a time to first token no prompt token explains, learnt with the prefill rate."""


@dataclass(frozen=True, slots=True)
class LatencyView:
    """What the decision reads of the latency models: each replica's fit, the tokens a prefix
    block stands for where the prompt is not tokenized (the config's ``block_chars`` / 4), and
    each replica's learned rates where its observations give them (``rates``; a replica
    missing there has its rates derived from its fit, or its pool's prior, ``priors``)."""

    fits: Mapping[str, LatencyFit] = field(default_factory=dict)
    block_tokens: int = 16
    rates: Mapping[str, LearnedRates] = field(default_factory=dict)
    priors: tuple[PoolRates, ...] = ()
    """The pools' prior rates (``health.engine_rates``), for a replica nothing was learnt of."""
    output_tokens: Mapping[str, float] = field(default_factory=dict)
    """Each model's mean output tokens where enough answers were seen
    (:class:`~extproc.fleet.health.output_lengths.OutputLengths`)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """A candidate's predicted latencies for this request (None: its model is not warm)."""

    ttft_s: float | None
    tpot_s: float | None


def has_objectives(features: RequestFeatures) -> bool:
    """Whether the request asked for a TTFT or TPOT objective."""
    return features.slo_ttft_ms is not None or features.slo_tpot_ms is not None


def headroom(features: RequestFeatures, prediction: Prediction) -> float | None:
    """The smaller share of its objectives a prediction leaves unused (negative: it misses by that
    share); None when no objective of the request has a prediction."""
    shares = []
    if features.slo_ttft_ms is not None and prediction.ttft_s is not None:
        shares.append(1.0 - prediction.ttft_s * 1000.0 / features.slo_ttft_ms)
    if features.slo_tpot_ms is not None and prediction.tpot_s is not None:
        shares.append(1.0 - prediction.tpot_s * 1000.0 / features.slo_tpot_ms)
    return min(shares) if shares else None


def verdict(features: RequestFeatures, predicted: Mapping[str, Prediction], missed: bool) -> tuple[str, str]:
    """What a decision predicted of the request's objectives, and why: ``("", ...)`` without
    objectives, ``"unknown"`` where no candidate has a warm model for them, else ``"met"`` or
    ``"missed"`` (every candidate late, or short of its class's margin), with the best
    candidate's prediction (for Explain)."""
    if not has_objectives(features):
        return "", "the request has no latency objectives"
    judged = {n: h for n, p in predicted.items() if (h := headroom(features, p)) is not None}
    if not judged:
        return "unknown", "no candidate's latency model is warm for these objectives: routed as without them"
    best = max(judged, key=lambda n: judged[n])
    p = predicted[best]
    parts = []
    if p.ttft_s is not None and features.slo_ttft_ms is not None:
        parts.append(f"TTFT {p.ttft_s * 1000:.0f} ms of {features.slo_ttft_ms:g}")
    if p.tpot_s is not None and features.slo_tpot_ms is not None:
        parts.append(f"TPOT {p.tpot_s * 1000:.1f} ms of {features.slo_tpot_ms:g}")
    shown = ", ".join(parts)
    if missed and judged[best] >= 0.0:  # short of its class's admit_margin
        return (
            "missed",
            f"no candidate leaves the class's margin; the best is {best} ({shown}, headroom {judged[best]:.0%})",
        )
    if missed:
        return "missed", f"every candidate is predicted to miss; the least late is {best} ({shown})"
    return "met", f"{best} is predicted to meet them ({shown}, headroom {judged[best]:.0%})"
