"""The trace context Envoy sends in the ext_proc stream's gRPC metadata (its own tracing on)
parents the decision's span, over a real channel to the real server and a real OTLP receiver."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.adapters.server import ProcessorServer
from extproc.adapters.server.envoy_messages import trace_context
from extproc.app.router import Router
from extproc.observe.tracing import DecisionTracer, TracingSettings
from tests.conftest import body_message, chat_body, headers_message, make_config, set_headers
from tests.helpers import ReceivedSpan, SpanReceiver, otlp_receiver

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ENVOY_SPAN = "e113b65ce42b6cec"  # Envoy's span of the ext_proc stream, a child of the request's


@pytest.fixture
def collected() -> Iterator[SpanReceiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture
async def served(collected: SpanReceiver) -> AsyncIterator[tuple[ProcessorServer, DecisionTracer]]:
    # sample_rate 0: only a sampled parent makes a span, so a span proves the parent was read.
    tracer = DecisionTracer(
        TracingSettings(enabled=True, endpoint=collected.address, sample_rate=0.0, sampler="parent_based")
    )
    server = ProcessorServer(Router(make_config(), tracer=tracer), "127.0.0.1:0")
    await server.start()
    try:
        yield server, tracer
    finally:
        await server.stop(0.5)
        await asyncio.to_thread(tracer.close)


async def _route(
    server: ProcessorServer, headers: dict[str, str], metadata: tuple[tuple[str, str], ...]
) -> dict[str, str]:
    """One request through a real stream; the headers set on it."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(
            iter([headers_message({":path": "/v1/chat/completions", **headers}), body_message(chat_body("hi"))]),
            metadata=metadata,
        )
        responses = [r async for r in call]
    return set_headers(responses[-1].request_body.response.header_mutation)


async def _spans(tracer: DecisionTracer, collected: SpanReceiver) -> tuple[ReceivedSpan, ReceivedSpan]:
    """The request's decision span and its call's (ended with the stream)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while len(collected.spans) < 2 and loop.time() < end:
        await asyncio.to_thread(tracer.provider.force_flush)
        await asyncio.sleep(0.05)  # real time: spans exported over OTLP to a real receiver
    assert len(collected.spans) == 2
    spans = {s.name: s for s in collected.spans}
    route, call = spans["route"], spans["chat m"]
    assert (call.trace_id, call.parent_span_id) == (route.trace_id, route.span_id)
    return route, call


async def test_envoys_context_in_the_metadata_parents_the_decision_without_a_client_header(
    served: tuple[ProcessorServer, DecisionTracer], collected: SpanReceiver
) -> None:
    server, tracer = served
    sent = await _route(server, {}, (("traceparent", f"00-{TRACE}-{ENVOY_SPAN}-01"), ("tracestate", "")))
    span, call = await _spans(tracer, collected)
    assert (span.trace_id, span.parent_span_id) == (TRACE, ENVOY_SPAN)
    assert sent["traceparent"] == f"00-{TRACE}-{call.span_id}-01"


async def test_envoys_context_wins_over_the_clients_header_it_descends_from(
    served: tuple[ProcessorServer, DecisionTracer], collected: SpanReceiver
) -> None:
    server, tracer = served
    client = {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01", "tracestate": "client=1"}
    await _route(server, client, (("traceparent", f"00-{TRACE}-{ENVOY_SPAN}-01"),))
    span, _ = await _spans(tracer, collected)
    assert (span.trace_id, span.parent_span_id) == (TRACE, ENVOY_SPAN)


async def test_without_envoys_context_the_clients_header_parents_the_decision(
    served: tuple[ProcessorServer, DecisionTracer], collected: SpanReceiver
) -> None:
    server, tracer = served
    await _route(server, {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}, (("x-envoy-internal", "true"),))
    span, _ = await _spans(tracer, collected)
    assert (span.trace_id, span.parent_span_id) == (TRACE, CLIENT_SPAN)


def test_only_the_w3c_trace_context_is_taken_from_the_metadata() -> None:
    metadata = (("x-forwarded-for", "192.0.2.2"), ("traceparent", "00-a-b-01"), ("tracestate", ""))
    assert trace_context(metadata) == {"traceparent": "00-a-b-01", "tracestate": ""}
    assert trace_context(None) == {}
