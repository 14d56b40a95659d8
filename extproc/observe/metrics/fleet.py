"""Instruments of the fleet: discovery, each replica's health, load, cache and engine rates,
sessions and their moves, hot prefixes, and the sizes of the bounded structures (the
``HealthObserver``, ``DiscoveryObserver`` and ``RebalanceObserver``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# Label values known in advance get their series at zero from the start, so that rates and alert
# expressions have data before the first event (an absent series is not a zero).
MOVE_REASONS = ("join", "leave", "hot")
PREWARM_OUTCOMES = ("ok", "error", "dropped", "unusable")


class FleetMetrics:
    """The fleet's instruments."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.discovery_lists = Counter(
            "extproc_discovery_lists", "Replica lists received from the discovery source.", registry=r
        )
        self.discovery_changes = Counter(
            "extproc_discovery_changes_applied",
            "Membership changes applied from discovery (after debouncing).",
            registry=r,
        )
        self.discovery_failures = Counter(
            "extproc_discovery_failures", "Times the discovery source failed and was restarted.", registry=r
        )
        self.discovery_members = Gauge(
            "extproc_discovery_members",
            "Replicas in the membership last applied from discovery (static ones included).",
            registry=r,
        )
        self.responses_observed = Counter(
            "extproc_responses_observed",
            "Responses whose headers the processor saw (status, time to first byte); the others were "
            "skipped by health.response_sample_rate.",
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
        self.replica_cache_fill = Gauge(
            "extproc_replica_cache_fill_ratio",
            "How full the replica's prefix cache is believed to be, in [0, 1]: the uncached prompt "
            "tokens this gateway sent there (since it joined, or since its engine restarted) over "
            "its KV capacity; 1 while the capacity is unknown.",
            ["replica"],
            registry=r,
        )
        self.replica_cache_trust = Gauge(
            "extproc_replica_cache_trust_ratio",
            "How far the prefix index's claims for the replica are believed, in (0, 1]: its hit "
            "counters against what the index claimed, moved only by scrapes where it counted queries.",
            ["replica"],
            registry=r,
        )
        self.replica_cache_evidence_age = Gauge(
            "extproc_replica_cache_evidence_age_seconds",
            "Seconds since the replica's prefix-cache counters last bore on the index's claims (a scrape "
            "where its query counter grew); -1 if they never did, and its trust rests on nothing it reported.",
            ["replica"],
            registry=r,
        )
        self.replica_sessions = Gauge(
            "extproc_replica_sessions_pinned",
            "Sessions this gateway has seen pinned to the replica within the session TTL.",
            ["replica"],
            registry=r,
        )
        self.replica_cordon = Gauge(
            "extproc_replica_cordon_state",
            "The operator's cordon: 0 none, 1 cordoned (no new sessions), 2 drained (no requests).",
            ["replica"],
            registry=r,
        )
        self.sessions_moved = Counter(
            "extproc_sessions_moved", "Sessions moved to another replica, by reason.", ["reason"], registry=r
        )
        self.prewarms = Counter(
            "extproc_prewarm_requests", "Pre-warm requests for moved sessions, by outcome.", ["outcome"], registry=r
        )
        self.sessions = Gauge("extproc_sessions", "Sessions held by the affinity store.", registry=r)
        # Per hot prefix, labelled by its fingerprint's hash (never the text); the label set is
        # cleared and refilled at each scrape, so it holds at most hot_keys.max_hot keys.
        self.hot_key_rate = Gauge(
            "extproc_hot_key_requests_per_second",
            "Estimated request rate of a hot prefix (hot_keys:), by its fingerprint.",
            ["key"],
            registry=r,
        )
        self.hot_key_replicas = Gauge(
            "extproc_hot_key_replicas", "Replicas a hot prefix is spread over, by its fingerprint.", ["key"], registry=r
        )
        # Sizes of the bounded structures, so a soak can check the bounds hold (sessions.max_sessions,
        # prefix.blocks_per_replica x replicas, rebalance.ledger_sessions / ledger_bytes).
        self.prefix_index_blocks = Gauge(
            "extproc_prefix_index_blocks", "Distinct prefix blocks in the affinity store's prefix index.", registry=r
        )
        self.ledger_sessions = Gauge(
            "extproc_session_ledger_sessions", "Sessions whose latest request is kept for moves.", registry=r
        )
        self.ledger_bytes = Gauge(
            "extproc_session_ledger_bytes", "Bytes of request bodies kept in the session ledger.", registry=r
        )
        self.engine_prefill_rate = Gauge(
            "extproc_engine_prefill_tokens_per_second",
            "A replica's cold prefill throughput (one request alone), learnt from its answers, else its pool's prior.",
            ["replica"],
            registry=r,
        )
        self.engine_decode_step = Gauge(
            "extproc_engine_decode_step_seconds",
            "A replica's seconds between two tokens of one request decoding alone, learnt, else its pool's prior.",
            ["replica"],
            registry=r,
        )
        self.latency_prediction_error = Gauge(
            "extproc_latency_prediction_error",
            "Absolute relative error of a replica's latency model over its recent predictions (each made before "
            "its observation), by latency (ttft, tpot) and quantile (0.5, 0.9); computed at scrape time.",
            ["replica", "latency", "quantile"],
            registry=r,
        )
        for reason in MOVE_REASONS:
            self.sessions_moved.labels(reason)
        for outcome in PREWARM_OUTCOMES:
            self.prewarms.labels(outcome)

    # HealthObserver (extproc.fleet.health.observer).
    def scrape_failed(self, replica: str) -> None:
        """One failed scrape."""
        self.scrape_errors.labels(replica).inc()

    def left_rotation(self, replica: str) -> None:
        """One ejection."""
        self.ejections.labels(replica).inc()

    # DiscoveryObserver (extproc.fleet.discovery.observer).
    def discovery_list(self) -> None:
        """One list received."""
        self.discovery_lists.inc()

    def membership_applied(self, members: int) -> None:
        """One change applied, and the members it left."""
        self.discovery_changes.inc()
        self.discovery_members.set(members)

    def discovery_failed(self) -> None:
        """One failure of the source."""
        self.discovery_failures.inc()

    # RebalanceObserver (extproc.fleet.rebalance.observer); repin_failed is RouterMetrics' own.
    def session_moved(self, reason: str) -> None:
        """One session moved, by reason."""
        self.sessions_moved.labels(reason).inc()

    def prewarmed(self, outcome: str) -> None:
        """One pre-warm, by outcome."""
        self.prewarms.labels(outcome).inc()
