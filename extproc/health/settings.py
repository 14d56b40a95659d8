"""Health settings: scraping, the score and the rotation state machine (config ``health:``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.health.rotation import RotationPolicy
from extproc.health.score import HealthLimits, HealthWeights


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Everything the replica book and the scraper need to judge replicas."""

    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 0.2
    stale_after_s: float = 2.0
    metrics_path: str = "/metrics"
    weights: HealthWeights = field(default_factory=HealthWeights)
    limits: HealthLimits = field(default_factory=HealthLimits)
    rotation: RotationPolicy = field(default_factory=RotationPolicy)
    upstream_fail_after: int = 3
    ttft_window_s: float = 60.0
    recent_half_life_s: float = 60.0
    # The share of requests whose response headers the processor asks Envoy for (status and time
    # to first byte for passive health; the end of prefill). Below 1.0 the others skip that
    # ext_proc message: fewer round trips, a cheaper processor (docs/performance.md).
    response_sample_rate: float = 1.0
