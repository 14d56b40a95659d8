"""A replica's health in [0, 1], from inference signals (never CPU).

Each signal becomes a penalty in [0, 1]; the score is one minus their weighted sum (weights are
normalised, so they only say what matters more). A replica that cannot be scraped at all is
scored 0: it is not answering, whatever its last page said.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HealthWeights:
    """How much each signal counts (config ``health.weights``)."""

    queue: float = 0.3
    kv_cache: float = 0.2
    ttft: float = 0.25
    errors: float = 0.25


@dataclass(frozen=True, slots=True)
class HealthLimits:
    """Where each penalty starts and where it is full (config ``health``)."""

    queue_full: int = 64
    kv_start: float = 0.85
    ttft_slo_s: float = 2.0
    error_rate_full: float = 0.5
    unreachable_after: int = 2


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


def penalties(signals: HealthSignals, limits: HealthLimits) -> dict[str, float]:
    """Each signal's penalty in [0, 1]."""
    ttft = 0.0
    if signals.ttft_p99_s is not None and limits.ttft_slo_s > 0:
        # Full penalty at twice the SLO: p99 over the SLO hurts, double the SLO is broken.
        ttft = _clip(signals.ttft_p99_s / limits.ttft_slo_s - 1.0)
    kv_span = max(1e-9, 1.0 - limits.kv_start)
    return {
        "queue": _clip(signals.queue / max(1, limits.queue_full)),
        "kv_cache": _clip((signals.kv_usage - limits.kv_start) / kv_span),
        "ttft": ttft,
        "errors": _clip(signals.error_rate / max(1e-9, limits.error_rate_full)),
    }


def health_score(signals: HealthSignals, weights: HealthWeights, limits: HealthLimits) -> float:
    """The score in [0, 1]; 0 for a replica that has not answered ``unreachable_after`` scrapes."""
    if signals.scrape_failures >= limits.unreachable_after:
        return 0.0
    p = penalties(signals, limits)
    w = {"queue": weights.queue, "kv_cache": weights.kv_cache, "ttft": weights.ttft, "errors": weights.errors}
    total = sum(max(0.0, v) for v in w.values()) or 1.0
    return _clip(1.0 - sum(max(0.0, w[k]) * p[k] for k in w) / total)
