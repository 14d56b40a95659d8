"""The affinity store's instruments: failed operations, round trips, availability (the
``StoreObserver`` of :mod:`extproc.state.store`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.observe.metrics.buckets import LATENCY_BUCKETS

# Label values known in advance get their series at zero from the start, so that rates and alert
# expressions have data before the first event (an absent series is not a zero).
STORE_OPERATIONS = ("lookup", "record", "forget", "rebalance", "transcript")


class StoreMetrics:
    """The store's instruments, and the ``StoreObserver`` a remote store reports through."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.store_errors = Counter(
            "extproc_store_errors", "Affinity store operations that failed.", ["operation"], registry=r
        )
        self.store_seconds = Histogram(
            "extproc_store_duration_seconds",
            "Round trips to a remote affinity store, by operation (lookup, record batch).",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.store_up = Gauge(
            "extproc_store_available", "1 while the affinity store is reachable, 0 during an outage.", registry=r
        )
        self.store_up.set(1)
        self.store_queued_writes = Gauge(
            "extproc_store_queued_writes",
            "Writes waiting for the affinity store: they pile up during an outage and drain after it.",
            registry=r,
        )
        for operation in STORE_OPERATIONS:
            self.store_errors.labels(operation)
        for operation in ("lookup", "record"):
            self.store_seconds.labels(operation)

    # StoreObserver (extproc.state.store): a remote store reports through these.
    def store_error(self, operation: str) -> None:
        """One failed store operation."""
        self.store_errors.labels(operation).inc()

    def store_latency(self, operation: str, seconds: float) -> None:
        """One store round trip."""
        self.store_seconds.labels(operation).observe(seconds)

    def store_available(self, available: bool) -> None:
        """The store became reachable or unreachable."""
        self.store_up.set(1 if available else 0)

    def store_queued(self, writes: int) -> None:
        """Writes waiting for the store."""
        self.store_queued_writes.set(writes)
