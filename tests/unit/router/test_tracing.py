"""Decision spans reach a real OTLP receiver (a gRPC server built from opentelemetry-proto),
parented to the client's ``traceparent``, and the replica is handed a context of the same trace."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

from extproc.router import Router
from extproc.tracing import DecisionTracer, TracingSettings
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
        await asyncio.sleep(0.05)


async def test_the_decision_span_is_parented_to_the_clients_traceparent(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=0.0))
    router = Router(make_config(), tracer=tracer)
    headers = {":path": "/v1/chat/completions", "x-session-id": "s", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    try:
        routed = await router.route(headers, chat_body("a prompt " * 40, max_tokens=7))
        await _flushed(tracer, collected, 1)
    finally:
        tracer.close()
    assert len(collected.spans) == 1
    span = collected.spans[0]
    assert span.trace_id == TRACE_ID and span.parent_span_id == CLIENT_SPAN
    attrs = span.attributes
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert routed.decision.replica is not None
    assert attrs["extproc.replica"] == routed.decision.replica.name
    assert attrs["extproc.reason"] == routed.decision.reason.value
    assert attrs["extproc.candidates"] == 3
    # The replica continues the same trace, under the decision's span.
    assert routed.traceparent == f"00-{TRACE_ID}-{span.span_id}-01"


async def test_an_unsampled_request_is_neither_exported_nor_given_a_context(collected: SpanReceiver) -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=0.0))
    router = Router(make_config(), tracer=tracer)
    try:
        plain = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt"))
        unsampled = {":path": "/v1/chat/completions", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"}
        declined = await router.route(unsampled, chat_body("a prompt"))
        await asyncio.to_thread(tracer.provider.force_flush)
    finally:
        tracer.close()
    assert plain.traceparent is None and declined.traceparent is None
    assert collected.spans == []


async def test_an_unreachable_collector_costs_the_request_nothing() -> None:
    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint="127.0.0.1:9", sample_rate=1.0))
    router = Router(make_config(), tracer=tracer)
    try:
        routed = await router.route({":path": "/v1/chat/completions"}, chat_body("a prompt"))
    finally:
        await asyncio.to_thread(tracer.close)
    assert routed.decision.replica is not None and routed.traceparent is not None


async def test_the_plan_hands_the_replica_the_decisions_traceparent(collected: SpanReceiver) -> None:
    from extproc.plan import Forward, Planner

    tracer = DecisionTracer(TracingSettings(enabled=True, endpoint=collected.address, sample_rate=1.0))
    planner = Planner(Router(make_config(), tracer=tracer))
    try:
        plan = await planner.plan({":path": "/v1/chat/completions"}, chat_body("a prompt"))
        await _flushed(tracer, collected, 1)
    finally:
        tracer.close()
    assert isinstance(plan.action, Forward)
    sent = dict(plan.action.set_headers)
    span = collected.spans[0]
    _, trace_id, parent, flags = sent["traceparent"].split("-")
    assert (trace_id, parent) == (span.trace_id, span.span_id)
    assert int(flags, 16) & 1  # sampled: the engine traces it too


def test_an_exporter_that_does_not_load_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.tracing import TracingUnavailable

    # As when xds-protos' older copies of opentelemetry-proto's files were installed last.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(TracingUnavailable, match="force-reinstall opentelemetry-proto"):
        DecisionTracer(TracingSettings(enabled=True))
