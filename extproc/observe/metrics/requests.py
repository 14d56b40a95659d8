"""Instruments of the requests the processor routes: decisions and their prefix blocks, pairs of
disaggregated replicas, bodies, streams, splits, times to first token and to the end, and the
checks of Envoy's configuration and of TLS on its port."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.observe.metrics.buckets import (
    FIRST_TOKEN_BUCKETS,
    LATENCY_BUCKETS,
    OUTPUT_TOKEN_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
)
from extproc.routing.model import Reason
from extproc.routing.roles import PairReason

MAX_MODEL_LABELS = 32


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
# Label values known in advance get their series at zero from the start, so that rates and alert
# expressions have data before the first event (an absent series is not a zero).
STREAM_ERROR_KINDS = ("answer", "stream")
CONFIG_PROBLEM_KINDS = ("no_request_body",)


class RequestMetrics:
    """The requests' instruments."""

    def __init__(self, r: CollectorRegistry) -> None:
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
        self.tls_handshake_failures = Counter(
            "extproc_tls_handshake_failures",
            "TLS handshakes that failed on a TLS port of the router, by OpenSSL reason (WRONG_VERSION_NUMBER: "
            "a client speaking plaintext to it).",
            ["reason"],
            registry=r,
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
        # Envoy's ext_proc configuration as the processor sees it (extproc.adapters.server.envoy_check):
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
        self.observed_output_tokens = Histogram(
            "extproc_observed_output_tokens",
            "Output tokens of each answer whose body the router read (the usage its engine reported, "
            "else the events counted), by replica: what the price learns each model's answer length from.",
            ["replica"],
            buckets=OUTPUT_TOKEN_BUCKETS,
            registry=r,
        )
        for kind in STREAM_ERROR_KINDS:
            self.stream_errors.labels(kind)
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
