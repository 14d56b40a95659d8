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
