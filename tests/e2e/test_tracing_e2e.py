"""One trace holds Envoy's spans, the processor's decision and the replica's context: real Envoy
rendered with its own tracing (``envoy-config --tracing-collector``) and the processor with
``serve --tracing-endpoint`` both export to one in-test OTLP receiver; the fake replica lists the ``traceparent``
it was sent (``GET /trace_context``), the one a real engine would continue. Metering is on
(``budgets.enabled``), so the call to the replica carries the usage the response reported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import ReceivedSpan, SpanReceiver, chat, otlp_receiver, post, wait_for

pytestmark = pytest.mark.e2e

ENVOY = "envoy-gateway"
OURS = "extproc-router"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalGateway, SpanReceiver]]:
    require_binary("envoy")
    config = tmp_path_factory.mktemp("traced") / "router.yaml"
    config.write_text("budgets:\n  enabled: true\n")
    with otlp_receiver() as receiver:
        # Envoy samples every request (GatewaySpec's default); the processor follows its context.
        gw = LocalGateway(
            replicas=1,
            time_scale=0.02,
            tracing_collector=receiver.address,
            processor_args=("--config", str(config)),
        )
        with gw:
            yield gw, receiver


async def _traced_request(
    http: aiohttp.ClientSession, gw: LocalGateway, headers: dict[str, str]
) -> tuple[str, str, dict[str, Any]]:
    """One request through the gateway; the trace id and parent span id the replica was sent, and
    the usage the answer reported."""
    status, _, answer = await post(http, gw.url, chat("a traced question"), headers)
    assert status == 200 and answer is not None
    async with http.get(gw.replica_url("replica-0") + "/trace_context") as resp:
        received = json.loads(await resp.read())
    _, trace_id, parent, flags = received[-1]["traceparent"].split("-")
    assert int(flags, 16) & 1  # sampled: the engine records its span too
    return trace_id, parent, answer["usage"]


def _trace(receiver: SpanReceiver, trace_id: str) -> list[ReceivedSpan]:
    return [s for s in receiver.spans if s.trace_id == trace_id]


def _complete(receiver: SpanReceiver, trace_id: str) -> bool:
    """Envoy's span of the request, of the ext_proc stream, of the upstream try, and our two."""
    spans = _trace(receiver, trace_id)
    envoy = [s for s in spans if s.service == ENVOY]
    return len(envoy) >= 3 and len([s for s in spans if s.service == OURS]) >= 2


async def _one_trace(
    receiver: SpanReceiver, trace_id: str, replica_parent: str, usage: dict[str, Any]
) -> tuple[ReceivedSpan, ReceivedSpan]:
    """Envoy's ingress span and our decision span of ``trace_id``, checked to be one tree that
    the replica's parent belongs to, with our call to the replica under the decision."""
    await wait_for(lambda: _complete(receiver, trace_id), f"Envoy's spans and ours in trace {trace_id}", 20.0)
    spans = _trace(receiver, trace_id)
    envoy = {s.span_id: s for s in spans if s.service == ENVOY}
    (ours,) = [s for s in spans if s.service == OURS and s.name == "route"]
    assert ours.attributes["extproc.replica"] == "replica-0"
    # Ours hangs under Envoy's span of the ext_proc stream, itself under Envoy's span of the request.
    stream = envoy[ours.parent_span_id]
    assert "ExternalProcessor" in stream.name
    ingress = envoy[stream.parent_span_id]
    assert ingress.name == "ingress"
    # The call to the replica, under the decision, with the tokens the answer reported.
    (call,) = [s for s in spans if s.service == OURS and s.name == "chat demo-model"]
    assert call.parent_span_id == ours.span_id
    attrs = call.attributes
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert attrs["http.response.status_code"] == 200
    # The engine's parent is a span of this trace (Envoy's router writes its upstream span's
    # context over the one the processor set: Envoy 1.40).
    assert replica_parent in {*envoy, ours.span_id, call.span_id}
    return ingress, ours


async def test_a_request_without_context_is_one_trace_from_envoy_to_the_replica(
    traced: tuple[LocalGateway, SpanReceiver],
) -> None:
    gw, receiver = traced
    async with aiohttp.ClientSession() as http:
        trace_id, parent, usage = await _traced_request(http, gw, {})
    assert trace_id != CLIENT_TRACE
    ingress, _ = await _one_trace(receiver, trace_id, parent, usage)
    assert ingress.parent_span_id == ""  # Envoy started the trace


async def test_a_clients_traceparent_holds_envoy_ours_and_the_replicas(
    traced: tuple[LocalGateway, SpanReceiver],
) -> None:
    gw, receiver = traced
    async with aiohttp.ClientSession() as http:
        headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        trace_id, parent, usage = await _traced_request(http, gw, headers)
    assert trace_id == CLIENT_TRACE
    ingress, _ = await _one_trace(receiver, trace_id, parent, usage)
    assert ingress.parent_span_id == CLIENT_SPAN
