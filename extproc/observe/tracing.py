"""Traces of routing decisions: OpenTelemetry spans in the GenAI conventions, over OTLP.

A request's W3C ``traceparent`` (from the client, or from Envoy's own tracing: the ext_proc
stream's gRPC metadata, which :mod:`extproc.adapters.server.stream` puts first) parents a span for
the routing decision: the chosen replica, the reason, the cached tokens predicted there, the
candidates considered, the profile, and the request's model in the GenAI semantic conventions
(``gen_ai.request.model``, ``gen_ai.operation.name``, ``gen_ai.request.max_tokens``). Without one, a
trace is started. Under the decision, a GenAI client span (``chat MODEL``, kind CLIENT) is the
request's call to its replica: opened when it is decided, ended when its stream is over, with the
response's status and, where the response's usage is read (``budgets:`` reads every one; the
KV-event usage check its samples), ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``
and ``gen_ai.usage.cache_read.input_tokens``. The replica is handed a ``traceparent`` of the same
trace with that call as its parent (vLLM continues it with ``--otlp-traces-endpoint``), so one
trace holds Envoy's span, ours and the engine's. With Envoy's own tracing on, Envoy's router writes its upstream span's
context over that header (Envoy 1.40): the engine's parent is then Envoy's span, of the same trace.

Off by default. The operator decides what is traced (``sampler``): ``ratio`` (the default) traces
``sample_rate`` of the requests, taken evenly, whatever their ``traceparent`` says, so a client's
sampled flag (or a trace id it chose to pass a ratio test) forces nothing; the spans of a sampled
request still join the trace of its parent. ``parent_based`` follows a sampled parent (where
Envoy's own tracing decides for both), but only for ``parent_rate`` of the requests that carry one,
and starts a trace for ``sample_rate`` of the others. Spans are exported in batches from a thread of the
SDK's, off the request path; an unreachable collector drops spans (the SDK logs it) and never
slows or fails a request. The SDK is imported only when tracing is on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from extproc.base.sampling import RateSampler
from extproc.base.validation import Section, option
from extproc.request.features import RequestFeatures
from extproc.request.openai_body import CHAT_PATH
from extproc.request.usage import Usage
from extproc.routing.model import Decision

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult
    from opentelemetry.trace import Link, Span, SpanKind
    from opentelemetry.trace.span import TraceState
    from opentelemetry.util.types import Attributes

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_CONTEXT = (TRACEPARENT, TRACESTATE)
"""The W3C trace-context headers."""


class TracingSettings(Section):
    """Config ``tracing:``: decision spans over OTLP (off by default)."""

    enabled: bool = option(False, "export a span per sampled routing decision over OTLP/gRPC")
    endpoint: str = option("127.0.0.1:4317", "the OTLP/gRPC collector, HOST:PORT")
    insecure: bool = option(True, "plaintext to the collector (a sidecar or node agent); false for TLS")
    sample_rate: float = option(
        0.01, "share of requests traced (with sampler parent_based: of those without a sampled parent)", ge=0, le=1
    )
    sampler: Literal["ratio", "parent_based"] = option(
        "ratio",
        "ratio: sample_rate of every request, whatever its traceparent says; parent_based: follow a sampled "
        "parent (Envoy's tracing deciding for both) for parent_rate of the requests that carry one",
    )
    parent_rate: float = option(
        1.0, "with sampler parent_based: the share of requests with a sampled parent that are traced", ge=0, le=1
    )
    service_name: str = option("extproc-router", "the spans' service.name")
    propagate: bool = option(True, "hand the replica a traceparent whose parent is the decision's span")


def operator_sampler(settings: TracingSettings) -> Sampler:
    """The sampler ``settings`` describe: the operator's shares decide, never the trace id's bits
    (which the client chooses) and, with ``ratio``, never a client's sampled flag. Spans under one
    of ours (the call under the decision) follow it."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, SamplingResult
    from opentelemetry.sdk.trace.sampling import Decision as Verdict

    class Share(Sampler):
        """Takes ``rate`` of the spans it is asked about, evenly (:class:`RateSampler`), keeping
        the parent's trace state."""

        def __init__(self, rate: float) -> None:
            self.rate = rate
            self._taken = RateSampler()

        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Attributes = None,
            links: Sequence[Link] | None = None,
            trace_state: TraceState | None = None,
        ) -> SamplingResult:
            verdict = Verdict.RECORD_AND_SAMPLE if self._taken.take(self.rate) else Verdict.DROP
            state = trace.get_current_span(parent_context).get_span_context().trace_state if parent_context else None
            return SamplingResult(verdict, None, state)

        def get_description(self) -> str:
            return f"OperatorShare{{{self.rate}}}"

    share = Share(settings.sample_rate)
    if settings.sampler == "ratio":
        return ParentBased(share, remote_parent_sampled=share, remote_parent_not_sampled=share)
    return ParentBased(share, remote_parent_sampled=Share(settings.parent_rate), remote_parent_not_sampled=ALWAYS_OFF)


class TracingUnavailable(RuntimeError):
    """The OTLP exporter cannot be loaded; the message says how to repair the install."""


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        # xds-protos (the ext_proc messages) ships older copies of opentelemetry-proto's files under
        # the same paths; when pip installs it last, the exporter finds the old ones.
        raise TracingUnavailable(
            f"tracing: the OTLP exporter does not load ({exc}); if xds-protos overwrote opentelemetry-proto's "
            "files, reinstall it last: pip install --no-deps --force-reinstall opentelemetry-proto"
        ) from None
    return OTLPSpanExporter(endpoint=settings.endpoint, insecure=settings.insecure)


class InferenceSpan:
    """A request's call to its replica, as an OpenTelemetry GenAI client span: open from the
    decision until :meth:`end`. ``traceparent`` is its context, handed to the replica (None:
    propagation is off)."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Span, traceparent: str | None) -> None:
        self._span = span
        self.traceparent = traceparent

    def usage(self, usage: Usage) -> None:
        """The tokens the response reported, in the GenAI conventions."""
        attrs = {"gen_ai.usage.input_tokens": usage.input, "gen_ai.usage.output_tokens": usage.output}
        if usage.cached_input is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = usage.cached_input
        self._span.set_attributes(attrs)

    def end(self, status: int) -> None:
        """The request is over; ``status`` its response's, 0 when its headers were not seen (not
        asked for, or no answer came: the span cannot tell which, so claims neither)."""
        if not self._span.is_recording():
            return
        if status:
            self._span.set_attribute("http.response.status_code", status)
        if status >= 400:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_attribute("error.type", str(status))
            self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()


class DecisionTracer:
    """Spans for routing decisions (see the module docstring); ``exporter`` replaces the OTLP
    exporter (tests)."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            exporter = _otlp_exporter(settings)
        self.settings = settings
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=operator_sampler(settings),
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        self.tracer = self.provider.get_tracer("extproc.app.router")
        self.propagator = TraceContextTextMapPropagator()

    def decided(
        self,
        headers: Mapping[str, str],
        features: RequestFeatures,
        decision: Decision,
        started_ns: int,
        candidates: int,
        profile: str,
    ) -> InferenceSpan | None:
        """Record the decision's span (from ``started_ns``, wall clock, to now) and open the call
        to the chosen replica under it; None when the request is not sampled (the client's
        ``traceparent``, if any, then goes on unchanged) or has no replica."""
        from opentelemetry import trace

        parent = self.propagator.extract(carrier=dict(headers) if TRACEPARENT in headers else {})
        span = self.tracer.start_span("route", context=parent, start_time=started_ns)
        if not span.is_recording():
            return None
        span.set_attributes(self._attributes(features, decision, candidates, profile))
        span.end()
        if decision.replica is None:
            return None
        call = self.tracer.start_span(
            f"{_operation(features)} {features.model}".rstrip(),
            context=trace.set_span_in_context(span),
            kind=trace.SpanKind.CLIENT,
            attributes=self._call_attributes(features, decision),
        )
        traceparent = None
        if self.settings.propagate:
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier, context=trace.set_span_in_context(call))
            traceparent = carrier.get(TRACEPARENT)
        return InferenceSpan(call, traceparent)

    @staticmethod
    def _call_attributes(features: RequestFeatures, decision: Decision) -> dict[str, Any]:
        """The request's, in the GenAI conventions, and the replica it goes to: both spans'."""
        attrs: dict[str, Any] = {"gen_ai.operation.name": _operation(features), "gen_ai.request.model": features.model}
        if features.max_output_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = features.max_output_tokens
        if decision.replica is not None:
            attrs.update(_server(decision.replica.address))
            attrs["extproc.replica"] = decision.replica.name
        return attrs

    @classmethod
    def _attributes(
        cls, features: RequestFeatures, decision: Decision, candidates: int, profile: str
    ) -> dict[str, Any]:
        attrs = cls._call_attributes(features, decision)
        attrs.update(
            {
                "extproc.reason": decision.reason.value,
                "extproc.profile": profile,
                "extproc.candidates": candidates,
                "extproc.prefix.total_blocks": decision.total_blocks,
                "extproc.prefix.matched_blocks": decision.matched_blocks,
            }
        )
        if features.tokens_per_block:
            attrs["extproc.predicted_cached_tokens"] = decision.matched_blocks * features.tokens_per_block
        if decision.moved_by:
            attrs["extproc.moved_by"] = decision.moved_by
        if decision.pair is not None:  # a fleet with roles: the pair, and its prefill hop if any
            attrs["extproc.pair"] = decision.pair.value
            if decision.prefill is not None:
                attrs["extproc.prefill.replica"] = decision.prefill.name
                attrs["extproc.prefill.transfer_blocks"] = decision.transfer_blocks
        if features.request_id:
            attrs["extproc.request_id"] = features.request_id
        return attrs

    def close(self) -> None:
        """Export what is pending and stop."""
        self.provider.shutdown()


def _operation(features: RequestFeatures) -> str:
    return "chat" if features.path.startswith(CHAT_PATH) else "text_completion"


def _server(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"server.address": host, "server.port": int(port)} if port.isdigit() else {"server.address": address}
