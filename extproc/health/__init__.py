"""Replica health: vLLM metrics parsing, the health score, the rotation state machine, the scraper."""

from extproc.health.observer import HealthObserver, NullHealthObserver
from extproc.health.rotation import Rotation, RotationPolicy, step
from extproc.health.score import HealthLimits, HealthSignals, HealthWeights, health_score
from extproc.health.settings import HealthSettings
from extproc.health.vllm_metrics import MetricsPageError, ReplicaMetrics, parse_vllm_metrics

__all__ = [
    "HealthLimits",
    "HealthObserver",
    "HealthSettings",
    "HealthSignals",
    "HealthWeights",
    "MetricsPageError",
    "NullHealthObserver",
    "ReplicaMetrics",
    "Rotation",
    "RotationPolicy",
    "health_score",
    "parse_vllm_metrics",
    "step",
]
