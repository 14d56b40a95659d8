"""Metrics of the KV-event feeds, per replica (labels: replica names, and a small fixed set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class KvEventMetrics:
    """Counters and gauges of :class:`~extproc.kvevents.feed.KvEventSource`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        self.batches = Counter("extproc_kv_event_batches", "KV-event batches applied", ["replica"], registry=r)
        self.events = Counter("extproc_kv_events", "KV events applied, by kind", ["replica", "kind"], registry=r)
        self.blocks = Counter(
            "extproc_kv_event_blocks", "Blocks stored or removed by events", ["replica", "op"], registry=r
        )
        self.dropped = Counter(
            "extproc_kv_events_dropped", "Messages or events that did not decode", ["replica"], registry=r
        )
        self.gaps = Counter("extproc_kv_event_gaps", "Sequence gaps seen", ["replica"], registry=r)
        self.replays = Counter(
            "extproc_kv_event_replays", "Replays asked for, by outcome", ["replica", "outcome"], registry=r
        )
        self.restarts = Counter(
            "extproc_kv_event_restarts", "Engine restarts (sequence going back)", ["replica"], registry=r
        )
        self.clears = Counter(
            "extproc_kv_event_clears",
            "Times a replica's entries were dropped, by cause",
            ["replica", "cause"],
            registry=r,
        )
        self.lag = Histogram(
            "extproc_kv_event_lag_seconds",
            "Publish-to-apply delay of batches",
            ["replica"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.index_blocks = Gauge(
            "extproc_kv_index_blocks", "Indexed (block, tier) entries per replica", ["replica"], registry=r
        )
        self.index_keys = Gauge("extproc_kv_index_keys", "Distinct block keys in the event index", registry=r)
        self.last_seq = Gauge(
            "extproc_kv_feed_last_seq", "Sequence number of the last batch applied", ["replica"], registry=r
        )
        self.live = Gauge(
            "extproc_kv_feed_live", "1 when the replica's matches come from its events", ["replica"], registry=r
        )
        self.predicted_tokens = Counter(
            "extproc_kv_predicted_cached_tokens",
            "Cached prompt tokens the index predicted for the chosen replica",
            ["replica"],
            registry=r,
        )
        self.reported_tokens = Counter(
            "extproc_kv_reported_cached_tokens",
            "Cached prompt tokens the replica reported for the same requests",
            ["replica"],
            registry=r,
        )
        self.prediction_checks = Counter(
            "extproc_kv_prediction_checks",
            "Predictions checked against a reported hit, by outcome",
            ["replica", "outcome"],
            registry=r,
        )
        self.block_size = Gauge(
            "extproc_kv_events_block_size",
            "Block size in tokens the replica's engine reports (its events, else cache_config_info)",
            ["replica"],
            registry=r,
        )
        self.block_size_mismatch = Gauge(
            "extproc_kv_events_block_size_mismatch",
            "1 while the replica reports another block size than kv_events.block_size",
            ["replica"],
            registry=r,
        )
        self.hash_mismatch = Gauge(
            "extproc_kv_events_hash_algo_mismatch",
            "1 while the replica reports another prefix_caching_hash_algo than kv_events.hash_algo",
            ["replica"],
            registry=r,
        )
        self.suspended = Gauge(
            "extproc_kv_feed_suspended",
            "1 while the replica's feed is not used although it speaks, by cause (block_size, hash_algo, predictions)",
            ["replica", "cause"],
            registry=r,
        )
        self.suspensions = Counter(
            "extproc_kv_feed_suspensions",
            "Times a replica's feed was set aside, by cause",
            ["replica", "cause"],
            registry=r,
        )
