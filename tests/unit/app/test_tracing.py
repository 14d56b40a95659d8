"""Decision spans reach a real OTLP receiver (a gRPC server built from opentelemetry-proto),
parented to the client's ``traceparent``, and the replica is handed a context of the same trace."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

from extproc.app.router import Router
from extproc.observe.tracing import DecisionTracer, TracingSettings
from extproc.request.usage import Usage
from tests.conftest import chat_body, make_config
from tests.helpers import SpanReceiver, otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def collected() -> Iterator[SpanReceiver]:
    with otlp_receiver() as receiver:
        yield receiver


async def _flushed(tracer: DecisionTracer, collected: SpanReceiver, want: int) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while len(collected.spans) < want and loop.time() < end:
        await asyncio.to_thread(tracer.provider.force_flush)
        await asyncio.sleep(0.05)  # real time: spans exported over OTLP to a real receiver


async def test_the_decision_span_is_parented_to_the_clients_traceparent(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(
        TracingSettings(enabled=True, endpoint=collected.address, sample_rate=0.0, sampler="parent_based")
    )
    router = Router(make_config(), tracer=tracer)
    headers = {":path": "/v1/chat/completions", "x-session-id": "s", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    try:
        routed = await router.route(headers, chat_body("a prompt " * 40, max_tokens=7))
        await _flushed(tracer, collected, 1)
    finally:
        tracer.close()
    # The call to the replica is still open (the request is not over): only the decision is out.
    assert len(collected.spans) == 1
    span = collected.spans[0]
    assert span.name == "route"
    assert span.trace_id == TRACE_ID and span.parent_span_id == CLIENT_SPAN
    attrs = span.attributes
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert routed.decision.replica is not None
    assert attrs["extproc.replica"] == routed.decision.replica.name
    assert attrs["extproc.reason"] == routed.decision.reason.value
    assert attrs["extproc.candidates"] == 3
    assert routed.trace is not None and routed.trace.traceparent is not None
    assert routed.trace.traceparent.startswith(f"00-{TRACE_ID}-")


async def test_the_call_to_the_replica_carries_the_usage_its_response_reported(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=1.0))
    router = Router(make_config(), tracer=tracer)
    try:
        routed = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt", max_tokens=9))
        assert routed.trace is not None
        sent = routed.trace.traceparent
        routed.status = 200
        await router.charges.charge_usage(routed, Usage(input=120, cached_input=96, output=9))
        router.release(routed)
        router.release(routed)  # a second release ends nothing twice
        await _flushed(tracer, collected, 2)
    finally:
        tracer.close()
    spans = {s.name: s for s in collected.spans}
    assert len(collected.spans) == 2 and set(spans) == {"route", "chat m"}
    route, call = spans["route"], spans["chat m"]
    # One trace: the call under the decision, and the replica's context under the call.
    assert call.trace_id == route.trace_id and call.parent_span_id == route.span_id
    assert sent is not None and sent.startswith(f"00-{call.trace_id}-{call.span_id}-")
    assert int(sent.rpartition("-")[2], 16) & 1  # sampled
    assert call.attributes["gen_ai.usage.input_tokens"] == 120
    assert call.attributes["gen_ai.usage.output_tokens"] == 9
    assert call.attributes["gen_ai.usage.cache_read.input_tokens"] == 96
    assert call.attributes["http.response.status_code"] == 200
    assert call.attributes["gen_ai.request.model"] == "m" and call.attributes["gen_ai.request.max_tokens"] == 9
    assert routed.decision.replica is not None
    assert call.attributes["server.port"] == int(routed.decision.replica.address.rpartition(":")[2])
    assert "error.type" not in call.attributes


async def test_a_failed_call_is_an_error_and_unreported_usage_is_absent(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=1.0))
    router = Router(make_config(), tracer=tracer)
    try:
        failed = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt"))
        failed.status = 503
        router.release(failed)
        unseen = await router.route({":path": "/v1/completions"}, b'{"model": "m", "prompt": "p"}')
        router.release(unseen)  # its response headers were never seen
        await _flushed(tracer, collected, 4)
    finally:
        tracer.close()
    calls = [s for s in collected.spans if s.name != "route"]
    by_name = {s.name: s for s in calls}
    assert set(by_name) == {"chat m", "text_completion m"}
    error = by_name["chat m"].attributes
    assert error["error.type"] == "503" and error["http.response.status_code"] == 503
    assert not any(k.startswith("gen_ai.usage.") for k in error)
    # Not seen is not claimed as a failure: no status, no error.
    assert not {"error.type", "http.response.status_code"} & set(by_name["text_completion m"].attributes)


async def test_an_unsampled_request_is_neither_exported_nor_given_a_context(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(
        TracingSettings(enabled=True, endpoint=collected.address, sample_rate=0.0, sampler="parent_based")
    )
    router = Router(make_config(), tracer=tracer)
    try:
        plain = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt"))
        unsampled = {":path": "/v1/chat/completions", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"}
        declined = await router.route(unsampled, chat_body("a prompt"))
        await asyncio.to_thread(tracer.provider.force_flush)
    finally:
        tracer.close()
    assert plain.trace is None and declined.trace is None
    assert collected.spans == []


async def test_an_unreachable_collector_costs_the_request_nothing() -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint="127.0.0.1:9", sample_rate=1.0))
    router = Router(make_config(), tracer=tracer)
    try:
        routed = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt"))
    finally:
        await asyncio.to_thread(tracer.close)
    assert routed.decision.replica is not None and routed.trace is not None and routed.trace.traceparent


async def test_the_plan_hands_the_replica_its_calls_traceparent(collected: SpanReceiver) -> None:
    from extproc.app.plan import Forward, Planner

    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=1.0))
    planner = Planner(Router(make_config(), tracer=tracer))
    try:
        plan = await planner.plan({":path": "/v1/chat/completions"}, chat_body("a prompt"))
        planner.end(plan)
        await _flushed(tracer, collected, 2)
    finally:
        tracer.close()
    assert isinstance(plan.action, Forward)
    sent = dict(plan.action.set_headers)
    (span,) = [s for s in collected.spans if s.name == "chat m"]
    _, trace_id, parent, flags = sent["traceparent"].split("-")
    assert (trace_id, parent) == (span.trace_id, span.span_id)
    assert int(flags, 16) & 1  # sampled: the engine traces it too


def test_an_exporter_that_does_not_load_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.observe.tracing import TracingUnavailable

    # As when xds-protos' older copies of opentelemetry-proto's files were installed last.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(TracingUnavailable, match="force-reinstall opentelemetry-proto"):
        DecisionTracer(TracingSettings(enabled=True))


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        # The default: the operator's share of every request, whatever the client's flag says.
        ({"sample_rate": 0.25}, 10),
        # Parent-based, bounded: a sampled parent is followed for parent_rate of the requests.
        ({"sample_rate": 0.0, "sampler": "parent_based", "parent_rate": 0.5}, 20),
        ({"sample_rate": 0.0, "sampler": "parent_based"}, 40),
    ],
    ids=["ratio", "parent-based-bounded", "parent-based"],
)
async def test_a_client_s_sampled_traceparent_forces_no_more_than_the_operator_allows(
    collected: SpanReceiver, settings: dict[str, object], want: int
) -> None:
    # Trace id 0...01: a ratio test on the id's low bits (TraceIdRatioBased) would take it always.
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, **settings))  # type: ignore[arg-type]
    router = Router(make_config(), tracer=tracer)
    traced = 0
    try:
        for i in range(40):
            headers = {":path": "/v1/chat/completions", "traceparent": f"00-{1:032x}-{i + 1:016x}-01"}
            routed = await router.route(headers, chat_body(f"prompt {i}"))
            traced += routed.trace is not None
            router.release(routed)
        await _flushed(tracer, collected, 2 * want)
    finally:
        tracer.close()
    assert traced == want
    routes = [s for s in collected.spans if s.name == "route"]
    assert len(routes) == want and all(s.trace_id == f"{1:032x}" for s in routes)  # joined to the client's trace
    assert len(collected.spans) == 2 * want  # each call span followed its decision
