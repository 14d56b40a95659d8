"""Replica health: vLLM metrics parsing, the health score, the rotation state machine, the scraper."""

from extproc.fleet.health.observer import HealthObserver, NullHealthObserver
from extproc.fleet.health.rotation import Rotation, RotationPolicy, step
from extproc.fleet.health.score import HealthLimits, HealthSignals, HealthWeights, health_score
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.health.vllm_metrics import MetricsPageError, ReplicaMetrics, parse_vllm_metrics

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
