"""Instruments of admission: the queue, latency objectives, refusals, and the tokens metering
counts and budgets charge (the ``QueueObserver``, ``ObjectiveObserver`` and ``MeterObserver``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.observe.metrics.buckets import TTFT_BUCKETS
from extproc.observe.metrics.requests import BoundedLabel

# Label values known in advance get their series at zero from the start, so that rates and alert
# expressions have data before the first event (an absent series is not a zero).
SHED_REASONS = ("objective", "objective_timeout", "queue_full", "queue_timeout", "quota_exceeded", "tokens_exceeded")
TOKEN_KINDS = ("input", "cached_input", "output")


class AdmissionMetrics:
    """The queue's, the objectives', the refusals' and metering's instruments."""

    model_label: BoundedLabel
    """The models a label names (made by :class:`~extproc.observe.metrics.requests.RequestMetrics`)."""

    def __init__(self, r: CollectorRegistry) -> None:
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
        self.kv_room_wait_seconds = Histogram(
            "extproc_kv_room_wait_seconds",
            "Time a request waited for KV room on its replica (queueing.kv_room), once decided.",
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
        # Metering (budgets.enabled): tenants are the config's or "other", models bounded as
        # above, replicas the members (extproc.state.metering bounds the first two).
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
        for reason in SHED_REASONS:  # at zero for the default class: a dashboard shows "none" as 0
            self.requests_shed.labels("default", reason)

    # QueueObserver (extproc.fleet.queueing.observer).
    def queue_depth(self, priority: int, count: int) -> None:
        """Requests waiting at a priority."""
        self.queue_waiting.labels(str(priority)).set(count)

    def queue_waited(self, request_class: str, seconds: float) -> None:
        """One wait, by request class."""
        self.queue_wait_seconds.labels(request_class).observe(seconds)

    def kv_room_waited(self, seconds: float) -> None:
        """One request's wait for KV room (0 when it went at once)."""
        self.kv_room_wait_seconds.observe(seconds)

    def queue_outcome(self, request_class: str, outcome: str) -> None:
        """One held request's outcome."""
        self.queue_outcomes.labels(request_class, outcome).inc()

    # ObjectiveObserver (extproc.core.bookkeeping) and the router's refusals.
    def objective_judged(self, request_class: str, met: bool) -> None:
        """One request with objectives, met or missed."""
        self.objective_requests.labels(request_class, "met" if met else "missed").inc()

    def shed(self, request_class: str, reason: str) -> None:
        """One request refused, by reason (:data:`SHED_REASONS`)."""
        self.requests_shed.labels(request_class, reason).inc()

    # MeterObserver (extproc.state.metering).
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
