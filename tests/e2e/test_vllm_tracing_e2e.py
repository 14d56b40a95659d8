"""The engine's span joins the trace: real Envoy with its own tracing, the processor with
``--tracing-endpoint`` and one vLLM CPU engine (0.32) with ``--otlp-traces-endpoint``, all
exporting to one in-test OTLP receiver. One engine of the session's shared fleet
(tests/e2e/conftest.py: its engines export to the session's receiver); a missing venv is built
first, and failing to build it fails under CI and skips elsewhere."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.fleet import ENGINE_SERVICE as ENGINE
from tests.conftest import require_binary
from tests.e2e.conftest import TinyEngines
from tests.helpers import ReceivedSpan, SpanReceiver, chat, post, wait_for

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, tiny_engines: TinyEngines
) -> Iterator[tuple[LocalGateway, SpanReceiver]]:
    require_binary("envoy")
    receiver = tiny_engines.receiver
    # Envoy, the processor and the engine all to the receiver (the engine: --otlp-traces-endpoint).
    gw = LocalGateway(
        replicas=1,
        engines=tiny_engines.fresh(),
        kv_events=False,
        log_dir=tmp_path_factory.mktemp("vllm-trace-gw"),
        tracing_collector=receiver.address,
    )
    with gw:
        yield gw, receiver


def _by_trace(receiver: SpanReceiver, trace_id: str) -> list[ReceivedSpan]:
    return [s for s in receiver.spans if s.trace_id == trace_id]


async def test_envoy_the_decision_and_the_engine_share_the_clients_trace(
    traced: tuple[LocalGateway, SpanReceiver],
) -> None:
    gw, receiver = traced
    async with aiohttp.ClientSession() as http:
        body = chat("hi", model=gw.engine_settings.served_name)
        status, _, _ = await post(http, gw.url, body, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert status == 200

    def whole() -> bool:
        services = {s.service for s in _by_trace(receiver, CLIENT_TRACE)}
        return {"envoy-gateway", "extproc-router", ENGINE} <= services

    await wait_for(whole, "Envoy's, the processor's and the engine's spans in the client's trace", 30.0)
    spans = _by_trace(receiver, CLIENT_TRACE)
    envoy = {s.span_id: s for s in spans if s.service == "envoy-gateway"}
    (ours,) = [s for s in spans if s.service == "extproc-router" and s.name == "route"]
    (engine,) = [s for s in spans if s.service == ENGINE and s.name == "llm_request"]
    assert ours.parent_span_id in envoy
    # The engine continues the context Envoy's router sends it: its upstream try's span.
    assert envoy[engine.parent_span_id].name.startswith("router ")
