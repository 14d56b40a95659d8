"""Prometheus metrics of the router, on their own registry and their own port.

Each subsystem says what it reports in an observer protocol of its own (``health.observer``,
``discovery.observer``, ``rebalance.observer``, ``queueing.observer``, ``kvevents.observer``,
``state.store.StoreObserver``, ``metering.MeterObserver``), with a null default;
:class:`RouterMetrics` implements all but the KV events', which
:class:`~extproc.observe.metrics.kv_events.KvEventMetrics` implements. Only the wiring (the router facade,
the server, the CLI) knows these classes. Its instruments are grouped by what they watch:
:mod:`.requests`, :mod:`.fleet`, :mod:`.admission`, :mod:`.store` (the buckets in :mod:`.buckets`),
and what replicas report of themselves in :mod:`.replica_reports`.

Labels stay bounded: decision reasons, replica names, and model names (the first
``MAX_MODEL_LABELS`` seen; any further model is counted as ``other``, since the model comes from
the client), tenants (the config's; any other is ``other``). Never a session, a prompt, a user or
an API key.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.observe.metrics.admission import AdmissionMetrics
from extproc.observe.metrics.fleet import FleetMetrics
from extproc.observe.metrics.replica_reports import ReplicaReport, ReplicaReportCollector
from extproc.observe.metrics.requests import MAX_MODEL_LABELS, BoundedLabel, RequestMetrics
from extproc.observe.metrics.store import StoreMetrics

__all__ = [
    "MAX_MODEL_LABELS",
    "BoundedLabel",
    "ReplicaReport",
    "ReplicaReportCollector",
    "RouterMetrics",
]


class RouterMetrics(RequestMetrics, FleetMetrics, StoreMetrics, AdmissionMetrics):
    """The router's instruments."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        RequestMetrics.__init__(self, r)
        FleetMetrics.__init__(self, r)
        StoreMetrics.__init__(self, r)
        AdmissionMetrics.__init__(self, r)

    # The two below touch instruments of more than one group.
    def replica_seen(self, replica: str) -> None:
        """Create a replica's counter series at zero (called for every member at each scrape)."""
        self.scrape_errors.labels(replica)
        self.ejections.labels(replica)
        for how in ("stream", "unary"):
            self.ttft_seconds.labels(replica, how)
        self.request_seconds.labels(replica)

    # RebalanceObserver (extproc.fleet.rebalance.observer); its other methods are FleetMetrics'.
    def repin_failed(self) -> None:
        """A failed re-pin counts as a store error of the rebalance."""
        self.store_errors.labels("rebalance").inc()
