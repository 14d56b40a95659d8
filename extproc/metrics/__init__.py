"""Prometheus metrics of the router, on their own registry and their own port.

Each subsystem says what it reports in an observer protocol of its own (``health.observer``,
``discovery.observer``, ``rebalance.observer``, ``queueing.observer``, ``kvevents.observer``,
``state.store.StoreObserver``, ``metering.MeterObserver``), with a null default;
:class:`RouterMetrics` implements all but the KV events', which
:class:`~extproc.metrics.kv_events.KvEventMetrics` implements. Only the wiring (the router facade,
the server, the CLI) knows these classes.

Labels stay bounded: decision reasons, replica names, and model names (the first
``MAX_MODEL_LABELS`` seen; any further model is counted as ``other``, since the model comes from
the client), tenants (the config's; any other is ``other``). Never a session, a prompt, a user or
an API key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.routing.model import Reason
from extproc.routing.roles import PairReason

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
MAX_MODEL_LABELS = 32
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The router's own time to first token and end-to-end time per replica: finer than TTFT_BUCKETS
# where prefills sit (10 ms to 2 s), so a quantile read from them is within ~20% of the samples'.
FIRST_TOKEN_BUCKETS = (
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    30.0,
)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class BoundedLabel:
    """Passes the first ``limit`` distinct values through and maps every later one to ``other``;
    ``on_new`` runs once for each value admitted (to create its series at zero)."""

    def __init__(self, limit: int, on_new: Callable[[str], None] = lambda value: None) -> None:
        self.limit = limit
        self.on_new = on_new
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            value = "other"
            if value in self._seen:
                return value
        self._seen.add(value)
        self.on_new(value)
        return value


# Label values known in advance get their series at zero from the start, so that rates and alert
# expressions have data before the first event (an absent series is not a zero).
STREAM_ERROR_KINDS = ("answer", "stream")
STORE_OPERATIONS = ("lookup", "record", "forget", "rebalance", "transcript")
MOVE_REASONS = ("join", "leave", "hot")
PREWARM_OUTCOMES = ("ok", "error", "dropped", "unusable")
SHED_REASONS = ("objective", "objective_timeout", "queue_full", "queue_timeout", "quota_exceeded", "tokens_exceeded")
TOKEN_KINDS = ("input", "cached_input", "output")
CONFIG_PROBLEM_KINDS = ("no_request_body",)


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What the router last read from one replica's own /metrics page, re-exported."""

    replica: str
    prefix_hits_tokens: float | None
    prefix_queries_tokens: float | None
    last_scrape_unix: float | None


class ReplicaReportCollector(Collector):
    """Re-exports replica-reported counters (the real prefix-cache hit ratio needs them next to
    the router's estimate, also where Prometheus does not scrape the replicas itself) and the
    time of each replica's last good scrape (for a staleness alert)."""

    def __init__(self, rows: Callable[[], Sequence[ReplicaReport]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        """One family per signal, one sample per replica that reported it."""
        hits = CounterMetricFamily(
            "extproc_replica_prefix_cache_hits_tokens",
            "Prefix-cache hits in tokens, as the replica reports them (vllm:prefix_cache_hits_total).",
            labels=["replica"],
        )
        queries = CounterMetricFamily(
            "extproc_replica_prefix_cache_queries_tokens",
            "Prefix-cache queries in tokens, as the replica reports them (vllm:prefix_cache_queries_total).",
            labels=["replica"],
        )
        scraped = GaugeMetricFamily(
            "extproc_replica_last_scrape_timestamp_seconds",
            "Unix time of the last successful scrape of the replica's /metrics page.",
            labels=["replica"],
        )
        for row in self.rows():
            if row.prefix_hits_tokens is not None and row.prefix_queries_tokens is not None:
                hits.add_metric([row.replica], row.prefix_hits_tokens)
                queries.add_metric([row.replica], row.prefix_queries_tokens)
            if row.last_scrape_unix is not None:
                scraped.add_metric([row.replica], row.last_scrape_unix)
        yield from (hits, queries, scraped)


class RouterMetrics:
    """The router's instruments."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "extproc_decisions", "Routing decisions by reason and model.", ["reason", "model"], registry=r
        )
        self.model_label = BoundedLabel(MAX_MODEL_LABELS, self._new_model)
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
        self.prefix_blocks_round_robin = Counter(
            "extproc_prefix_blocks_expected_round_robin",
            "Prefix blocks a replica picked uniformly at random would have held (the round-robin expectation).",
            registry=r,
        )
        self.disagg_decisions = Counter(
            "extproc_disagg_decisions",
            "Decisions where replicas carry roles (llm-d.ai/role), by the pair's outcome: disaggregated "
            "(a prefill hop), short, held, local, no_prefiller (aggregated on the decode replica), no_decoder.",
            ["outcome"],
            registry=r,
        )
        for pair_reason in PairReason:
            self.disagg_decisions.labels(pair_reason.value)
        self.prefill_hops = Counter(
            "extproc_disagg_prefill_hops",
            "Prefill hops asked of a replica for requests another replica decodes (x-prefiller-host-port).",
            ["replica"],
            registry=r,
        )
        self.transfer_blocks = Counter(
            "extproc_disagg_transfer_blocks",
            "KV blocks expected to cross from prefill to decode replicas (those the decode replica lacks).",
            registry=r,
        )
        self.discovery_lists = Counter(
            "extproc_discovery_lists", "Replica lists received from the discovery source.", registry=r
        )
        self.discovery_changes = Counter(
            "extproc_discovery_changes_applied",
            "Membership changes applied from discovery (after debouncing).",
            registry=r,
        )
        self.tls_handshake_failures = Counter(
            "extproc_tls_handshake_failures",
            "TLS handshakes that failed on a TLS port of the router, by OpenSSL reason (WRONG_VERSION_NUMBER: "
            "a client speaking plaintext to it).",
            ["reason"],
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
        self.body_errors = Counter(
            "extproc_request_body_errors", "Request bodies that could not be used for routing.", registry=r
        )
        self.conversations = Counter(
            "extproc_conversations",
            "Chat requests without a session key, by how their conversation was known: new, continued, unmatched.",
            ["match"],
            registry=r,
        )
        self.stream_errors = Counter(
            "extproc_stream_errors", "ext_proc streams that ended in an error, by kind.", ["kind"], registry=r
        )
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
        # Splits (canaries): labels are the config's rule names and target models, so bounded.
        self.split_requests = Counter(
            "extproc_split_requests", "Requests by split rule and arm (its target model).", ["rule", "arm"], registry=r
        )
        self.split_errors = Counter(
            "extproc_split_errors",
            "Responses of 5xx (or none) by split rule and arm, as Envoy saw them.",
            ["rule", "arm"],
            registry=r,
        )
        self.split_ttft_seconds = Histogram(
            "extproc_split_ttft_seconds",
            "Time from the decision to the first token (a timed stream's first event; else the response "
            "headers), by rule and arm.",
            ["rule", "arm"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # Time to first token and end-to-end time per replica (replicas are members, so bounded),
        # observed through first_token() and request_completed(). The time to first token is the
        # one the latency models learn (docs/routing.md, "Observing the engine").
        self.ttft_seconds = Histogram(
            "extproc_ttft_seconds",
            "Time from the decision to the first token, as the router learnt it, by replica and how: "
            "stream (its first streamed event) or unary (its headers less the engine's decode time).",
            ["replica", "how"],
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "extproc_request_duration_seconds",
            "End-to-end time per replica: from the decision to the end of its response.",
            ["replica"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        # Envoy's ext_proc configuration as the processor sees it (extproc.server.envoy_check):
        # 1 while a problem of this kind is seen, with which routing cannot work.
        self.config_problem = Gauge(
            "extproc_config_problem",
            "1 while Envoy's ext_proc configuration cannot work, by kind (no_request_body: Envoy sends no "
            "request body, so nothing is routed).",
            ["kind"],
            registry=r,
        )
        for kind in CONFIG_PROBLEM_KINDS:
            self.config_problem.labels(kind).set(0)
        self.first_token_timeouts = Counter(
            "extproc_first_token_timeouts",
            "Timed streams ended by the processor because their replica sent no token within "
            "upstream.first_byte_s of the decision (its headers, which vLLM sends at once, or not), "
            "by the replica chosen.",
            ["replica"],
            registry=r,
        )
        self.observed_tpot_seconds = Histogram(
            "extproc_observed_tpot_seconds",
            "Time per output token after the first, as the router learnt it, by replica.",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Queueing: priorities and request classes come from the config, so bounded.
        self.queue_waiting = Gauge(
            "extproc_queue_waiting",
            "Requests held while every candidate is saturated, by priority.",
            ["priority"],
            registry=r,
        )
        self.queue_outcomes = Counter(
            "extproc_queue_outcomes",
            "Held requests by class and outcome (dispatched, timeout, full, gone).",
            ["request_class", "outcome"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "extproc_queue_wait_seconds",
            "Time held in the queue, by request class.",
            ["request_class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # Latency objectives: classes come from the config; replicas are members.
        self.objective_requests = Counter(
            "extproc_objective_requests",
            "Requests with latency objectives by class and outcome (met, missed), judged on the TTFT at the "
            "response headers (the router's queue included) and the TPOT at the stream's end.",
            ["class", "outcome"],
            registry=r,
        )
        self.requests_shed = Counter(
            "extproc_requests_shed",
            "Requests refused by the router, by class and reason (objective: every replica predicted to miss "
            "its objectives; objective_timeout: held for them past max_wait_s; queue_full; queue_timeout; "
            "quota_exceeded; tokens_exceeded).",
            ["class", "reason"],
            registry=r,
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
        # Metering (budgets.enabled): tenants are the config's or "other", models bounded as
        # above, replicas the members (extproc.metering bounds the first two).
        self.tokens = Counter(
            "extproc_tokens",
            "Tokens responses reported, by tenant, model, replica and kind (input: prefilled, "
            "cached_input: found cached, output: generated; the kinds add up to the whole).",
            ["tenant", "model", "replica", "kind"],
            registry=r,
        )
        self._token_series: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        # One series per configured budget and window (the config bounds them; keys by their name).
        self.budget_remaining = Gauge(
            "extproc_budget_remaining_tokens",
            "Weighted tokens left in a configured budget's window (less what requests in flight reserve).",
            ["kind", "name", "window"],
            registry=r,
        )
        self.budget_limit = Gauge(
            "extproc_budget_limit_tokens",
            "A configured budget's limit per window, in weighted tokens.",
            ["kind", "name", "window"],
            registry=r,
        )
        for kind in STREAM_ERROR_KINDS:
            self.stream_errors.labels(kind)
        for operation in STORE_OPERATIONS:
            self.store_errors.labels(operation)
        for operation in ("lookup", "record"):
            self.store_seconds.labels(operation)
        for reason in MOVE_REASONS:
            self.sessions_moved.labels(reason)
        for outcome in PREWARM_OUTCOMES:
            self.prewarms.labels(outcome)
        for reason in SHED_REASONS:  # at zero for the default class: a dashboard shows "none" as 0
            self.requests_shed.labels("default", reason)
        # At zero, so the alert on it has a series to read before the first failure (the likeliest
        # reason: a gateway speaking plaintext to the TLS port).
        self.tls_handshake_failures.labels("WRONG_VERSION_NUMBER")

    def _new_model(self, model: str) -> None:
        for reason in Reason:
            self.decisions.labels(reason.value, model)

    def disaggregated(self, outcome: str, prefill: str | None, transfer_blocks: int) -> None:
        """One decision over replicas with roles: its outcome, and its prefill hop if it made one."""
        self.disagg_decisions.labels(outcome).inc()
        if prefill is not None:
            self.prefill_hops.labels(prefill).inc()
            self.transfer_blocks.inc(transfer_blocks)

    def replica_seen(self, replica: str) -> None:
        """Create a replica's counter series at zero (called for every member at each scrape)."""
        self.scrape_errors.labels(replica)
        self.ejections.labels(replica)
        for how in ("stream", "unary"):
            self.ttft_seconds.labels(replica, how)
        self.request_seconds.labels(replica)

    def first_token(self, replica: str, seconds: float, how: str) -> None:
        """One request's time to first token on ``replica``, from its decision: ``how`` it was
        learnt, ``stream`` (its first streamed event) or ``unary`` (its headers less its decode)."""
        self.ttft_seconds.labels(replica, how).observe(seconds)

    def request_completed(self, replica: str, seconds: float) -> None:
        """One answered request's end-to-end time on ``replica``: from its decision to the end of
        its response (or of its stream, cut short)."""
        self.request_seconds.labels(replica).observe(seconds)

    def config_problem_seen(self, kind: str, present: bool) -> None:
        """A problem of Envoy's ext_proc configuration (:data:`CONFIG_PROBLEM_KINDS`) seen or gone."""
        self.config_problem.labels(kind).set(1 if present else 0)

    # HealthObserver (extproc.health.observer).
    def scrape_failed(self, replica: str) -> None:
        """One failed scrape."""
        self.scrape_errors.labels(replica).inc()

    def left_rotation(self, replica: str) -> None:
        """One ejection."""
        self.ejections.labels(replica).inc()

    # DiscoveryObserver (extproc.discovery.observer).
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

    # RebalanceObserver (extproc.rebalance.observer).
    def session_moved(self, reason: str) -> None:
        """One session moved, by reason."""
        self.sessions_moved.labels(reason).inc()

    def repin_failed(self) -> None:
        """A failed re-pin counts as a store error of the rebalance."""
        self.store_errors.labels("rebalance").inc()

    def prewarmed(self, outcome: str) -> None:
        """One pre-warm, by outcome."""
        self.prewarms.labels(outcome).inc()

    # QueueObserver (extproc.queueing.observer).
    def queue_depth(self, priority: int, count: int) -> None:
        """Requests waiting at a priority."""
        self.queue_waiting.labels(str(priority)).set(count)

    def queue_waited(self, request_class: str, seconds: float) -> None:
        """One wait, by request class."""
        self.queue_wait_seconds.labels(request_class).observe(seconds)

    def queue_outcome(self, request_class: str, outcome: str) -> None:
        """One held request's outcome."""
        self.queue_outcomes.labels(request_class, outcome).inc()

    # ObjectiveObserver (extproc.bookkeeping) and the router's refusals.
    def objective_judged(self, request_class: str, met: bool) -> None:
        """One request with objectives, met or missed."""
        self.objective_requests.labels(request_class, "met" if met else "missed").inc()

    def shed(self, request_class: str, reason: str) -> None:
        """One request refused, by reason (:data:`SHED_REASONS`)."""
        self.requests_shed.labels(request_class, reason).inc()

    # MeterObserver (extproc.metering).
    def tokens_used(self, tenant: str, model: str, replica: str, input: int, cached_input: int, output: int) -> None:
        """One response's tokens, by kind (the series looked up once per tenant, model and replica)."""
        key = (tenant, self.model_label(model), replica)
        series = self._token_series.get(key)
        if series is None:
            fresh, cached, out = (self.tokens.labels(*key, kind) for kind in TOKEN_KINDS)
            series = self._token_series[key] = (fresh, cached, out)
        if input:
            series[0].inc(input)
        if cached_input:
            series[1].inc(cached_input)
        if output:
            series[2].inc(output)

    def budget_stands(self, kind: str, name: str, window: str, remaining: float, limit: float) -> None:
        """One configured budget's window as it stands (read periodically, not per request)."""
        self.budget_remaining.labels(kind, name, window).set(remaining)
        self.budget_limit.labels(kind, name, window).set(limit)

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
