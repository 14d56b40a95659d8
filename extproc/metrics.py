"""Prometheus metrics of the router, on their own registry and their own port.

Labels stay bounded: decision reasons and replica names, never a session, prompt or user.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.routing.model import Reason

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class RouterMetrics:
    """The router's instruments."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("extproc_decisions", "Routing decisions by reason.", ["reason"], registry=r)
        for reason in Reason:
            self.decisions.labels(reason.value)
        self.decision_seconds = Histogram(
            "extproc_decision_duration_seconds",
            "Time from a complete request to a decision, store round trips included.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_blocks = Counter("extproc_prefix_blocks", "Prefix blocks of routed requests.", registry=r)
        self.prefix_blocks_matched = Counter(
            "extproc_prefix_blocks_matched",
            "Prefix blocks the chosen replica was believed to hold (estimated cache hits).",
            registry=r,
        )
        self.replica_inflight = Gauge(
            "extproc_replica_inflight_requests",
            "Requests sent to a replica and not finished.",
            ["replica"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "extproc_replica_scrape_errors", "Failed scrapes of a replica's /metrics page.", ["replica"], registry=r
        )
        self.ejections = Counter(
            "extproc_replica_ejections", "Times a replica left the rotation.", ["replica"], registry=r
        )
        self.replica_health = Gauge(
            "extproc_replica_health_score", "Replica health score in [0, 1].", ["replica"], registry=r
        )
        self.replica_in_rotation = Gauge(
            "extproc_replica_in_rotation", "1 when the replica is in rotation.", ["replica"], registry=r
        )
        self.replica_queue = Gauge(
            "extproc_replica_queue_requests", "Waiting requests, as last scraped.", ["replica"], registry=r
        )
        self.replica_kv_usage = Gauge(
            "extproc_replica_kv_cache_usage_ratio",
            "KV-cache usage in [0, 1], as last scraped.",
            ["replica"],
            registry=r,
        )
        self.sessions = Gauge("extproc_sessions", "Sessions held by the affinity store.", registry=r)
        self.body_errors = Counter(
            "extproc_request_body_errors", "Request bodies that could not be used for routing.", registry=r
        )
        self.stream_errors = Counter(
            "extproc_stream_errors", "ext_proc streams that ended in an error, by kind.", ["kind"], registry=r
        )
        self.store_errors = Counter(
            "extproc_store_errors", "Affinity store operations that failed.", ["operation"], registry=r
        )
