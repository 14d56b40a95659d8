"""Metrics of the KV-event feeds, per replica (labels: replica names, and a small fixed set).

Registered only where KV events are configured: :class:`KvEventMetrics` is the
:class:`~extproc.fleet.kvevents.observer.KvEventObserver` the server gives them.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class KvEventMetrics:
    """Counters and gauges of the KV-event feeds, their layouts and their predictions."""

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
        self.index_key_count = Gauge("extproc_kv_index_keys", "Distinct block keys in the event index", registry=r)
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
        self.tokenize_errors = Counter(
            "extproc_tokenize_errors", "Requests routed on character blocks: not tokenizable", registry=r
        )

    # The KvEventObserver protocol (extproc.fleet.kvevents.observer).
    def feed_added(self, replica: str) -> None:
        """Create the feed's counter series at zero."""
        for series in (self.batches, self.dropped, self.gaps, self.restarts):
            series.labels(replica)

    def feed_suspended(self, replica: str, cause: str) -> None:
        """One more suspension; the feed is set aside for ``cause``."""
        self.suspensions.labels(replica, cause).inc()
        self.suspended.labels(replica, cause).set(1)

    def feed_resumed(self, replica: str, cause: str) -> None:
        """The feed is no longer set aside for ``cause``."""
        self.suspended.labels(replica, cause).set(0)

    def messages_dropped(self, replica: str, count: int = 1) -> None:
        """Messages or events that did not decode."""
        self.dropped.labels(replica).inc(count)

    def replay_ended(self, replica: str, outcome: str) -> None:
        """One replay, by outcome."""
        self.replays.labels(replica, outcome).inc()

    def engine_restarted(self, replica: str) -> None:
        """One engine restart."""
        self.restarts.labels(replica).inc()

    def gap_seen(self, replica: str) -> None:
        """One sequence gap."""
        self.gaps.labels(replica).inc()

    def batch_applied(self, replica: str, lag_s: float | None) -> None:
        """One batch, and its publish-to-apply delay when known."""
        self.batches.labels(replica).inc()
        if lag_s is not None:
            self.lag.labels(replica).observe(lag_s)

    def events_applied(self, replica: str, kind: str, count: int) -> None:
        """Events applied, by kind."""
        self.events.labels(replica, kind).inc(count)

    def blocks_changed(self, replica: str, op: str, count: int) -> None:
        """Blocks stored or removed."""
        self.blocks.labels(replica, op).inc(count)

    def replica_cleared(self, replica: str, cause: str) -> None:
        """One clear of the replica's entries, by cause."""
        self.clears.labels(replica, cause).inc()

    def feed_state(self, replica: str, blocks: int, live: bool, last_seq: int | None) -> None:
        """The feed's gauges (-1 for no sequence number yet)."""
        self.index_blocks.labels(replica).set(blocks)
        self.live.labels(replica).set(1 if live else 0)
        self.last_seq.labels(replica).set(-1 if last_seq is None else last_seq)

    def index_keys(self, keys: int) -> None:
        """Distinct block keys in the index."""
        self.index_key_count.set(keys)

    def layout_reported(self, replica: str, block_size: int | None, size_off: bool, algo_off: bool) -> None:
        """The layout gauges (the block size only once one is known)."""
        if block_size is not None:
            self.block_size.labels(replica).set(block_size)
        self.block_size_mismatch.labels(replica).set(1 if size_off else 0)
        self.hash_mismatch.labels(replica).set(1 if algo_off else 0)

    def layout_forgotten(self, replica: str) -> None:
        """Remove the replica's layout series."""
        for gauge in (self.block_size, self.block_size_mismatch, self.hash_mismatch):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)

    def tokens_predicted(self, replica: str, tokens: int) -> None:
        """Cached tokens predicted for the chosen replica."""
        self.predicted_tokens.labels(replica).inc(tokens)

    def tokens_reported(self, replica: str, tokens: float) -> None:
        """Cached tokens the replica reported."""
        self.reported_tokens.labels(replica).inc(tokens)

    def prediction_checked(self, replica: str, outcome: str) -> None:
        """One checked prediction, by outcome."""
        self.prediction_checks.labels(replica, outcome).inc()

    def tokenize_failed(self) -> None:
        """One request not tokenized."""
        self.tokenize_errors.inc()
