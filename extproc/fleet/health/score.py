"""A replica's health in [0, 1], from inference signals (never CPU).

Each signal becomes a penalty in [0, 1]; the score is one minus their weighted sum (weights are
normalised, so they only say what matters more). A replica that cannot be scraped at all is
scored 0: it is not answering, whatever its last page said.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median_low

from extproc.base.validation import Section, option


class HealthWeights(Section):
    """``health.weights:``: how much each signal counts in the health score."""

    queue: float = option(0.3, "queued requests", ge=0)
    kv_cache: float = option(0.2, "KV-cache usage", ge=0)
    ttft: float = option(0.25, "time to first token over the SLO", ge=0)
    errors: float = option(0.25, "upstream error rate", ge=0)


class HealthLimits(Section):
    """``health.limits:``: where each penalty starts and where it is full."""

    queue_full: int = option(64, "queue length at which the queue penalty is full", ge=1)
    kv_start: float = option(0.85, "KV usage where its penalty starts", ge=0, le=1)
    ttft_slo_s: float = option(2.0, "TTFT p99 target", gt=0)
    error_rate_full: float = option(0.5, "error rate at which its penalty is full", gt=0, le=1)
    unreachable_after: int = option(2, "failed scrapes in a row before unreachable", ge=1)


@dataclass(frozen=True, slots=True)
class HealthSignals:
    """What is known of one replica at one evaluation."""

    queue: int = 0
    kv_usage: float = 0.0
    ttft_p99_s: float | None = None
    error_rate: float = 0.0
    scrape_failures: int = 0


def _clip(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def penalties(signals: HealthSignals, limits: HealthLimits, fleet: HealthSignals | None = None) -> dict[str, float]:
    """Each signal's penalty in [0, 1].

    Load (queue, KV usage, TTFT) is judged beyond what the ``fleet`` shows (its median replica,
    :func:`fleet_baseline`), when that is above the limits: a replica as loaded as its peers is
    not unhealthy, the fleet is busy, and taking it out of rotation would pile its share onto the
    others, which then look worse in turn. Errors and unreachability are judged on their own.
    """
    base = fleet or HealthSignals()
    ttft = 0.0
    slo = max(limits.ttft_slo_s, base.ttft_p99_s or 0.0)
    if signals.ttft_p99_s is not None and slo > 0:
        # Full penalty at twice the SLO: p99 over the SLO hurts, double the SLO is broken.
        ttft = _clip(signals.ttft_p99_s / slo - 1.0)
    kv_start = max(limits.kv_start, base.kv_usage)
    kv_span = max(1e-9, 1.0 - kv_start)
    return {
        "queue": _clip((signals.queue - base.queue) / max(1, limits.queue_full)),
        "kv_cache": _clip((signals.kv_usage - kv_start) / kv_span) if signals.kv_usage > kv_start else 0.0,
        "ttft": ttft,
        "errors": _clip(signals.error_rate / max(1e-9, limits.error_rate_full)),
    }


def fleet_baseline(signals: list[HealthSignals]) -> HealthSignals:
    """The fleet's median load, per signal (the lower median: with two replicas, the lighter one),
    over the replicas that report it."""

    if not signals:
        return HealthSignals()
    ttfts = [s.ttft_p99_s for s in signals if s.ttft_p99_s is not None]
    return HealthSignals(
        queue=median_low(s.queue for s in signals),
        kv_usage=median_low(s.kv_usage for s in signals),
        ttft_p99_s=median_low(ttfts) if ttfts else None,
    )


def health_score(
    signals: HealthSignals, weights: HealthWeights, limits: HealthLimits, fleet: HealthSignals | None = None
) -> float:
    """The score in [0, 1]; 0 for a replica that has not answered ``unreachable_after`` scrapes.
    ``fleet``: the fleet's median load, which load is judged beyond (:func:`penalties`)."""
    if signals.scrape_failures >= limits.unreachable_after:
        return 0.0
    p = penalties(signals, limits, fleet)
    w = {"queue": weights.queue, "kv_cache": weights.kv_cache, "ttft": weights.ttft, "errors": weights.errors}
    total = sum(max(0.0, v) for v in w.values()) or 1.0
    return _clip(1.0 - sum(max(0.0, w[k]) * p[k] for k in w) / total)
