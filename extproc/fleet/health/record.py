"""One replica's mutable bookkeeping behind its :class:`~extproc.routing.model.ReplicaState`: the
work the gateway sent there, what its /metrics page and real traffic said, its rotation."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from extproc.fleet.health.rotation import Rotation
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.routing.model import Replica, cache_fill

__all__ = ["ReplicaRecord"]


@dataclass(slots=True)
class ReplicaRecord:
    """Mutable per-replica bookkeeping behind a :class:`ReplicaState`."""

    replica: Replica
    inflight: int = 0
    inflight_tokens: int = 0
    pending_prefill_tokens: int = 0
    recent: float = 0.0
    recent_at: float = 0.0
    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0
    scraped_at: float = float("-inf")
    scrape_failures: int = 0
    refused: bool = False
    answered_at: float = float("-inf")
    """When Envoy last saw the replica answer a request."""
    metrics: ReplicaMetrics | None = None
    ttft_history: deque[tuple[float, tuple[tuple[float, float], ...]]] = field(default_factory=lambda: deque(maxlen=64))
    observed_ttfb: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))
    inter_token_s: float | None = None
    """The mean gap between two tokens of one request in the last scrape interval that had any
    (``vllm:inter_token_latency_seconds`` deltas), as the engine measured it."""
    error_rate: float = 0.0
    upstream_failures: int = 0
    rotation: Rotation = field(default_factory=Rotation)
    health: float = 1.0
    requests: int = 0
    errors: int = 0
    written_tokens: int = 0
    """The uncached prompt tokens this gateway sent there since the replica joined (or, after its
    engine restarted, the prompt tokens the new engine reports computing, then those sent)."""

    @property
    def kv_capacity_tokens(self) -> int:
        """Its KV cache in tokens, as last scraped (``vllm:cache_config_info``); 0 unknown."""
        return self.metrics.kv_capacity_tokens if self.metrics is not None else 0

    @property
    def cache_fill(self) -> float:
        """How full its prefix cache is believed to be (:func:`~extproc.routing.model.cache_fill`)."""
        return cache_fill(self.written_tokens, self.kv_capacity_tokens)
