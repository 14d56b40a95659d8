"""A client cannot make Envoy trace more than the operator's share: real Envoy rendered with its
own tracing (``envoy-config --tracing-collector``) exports to an in-test OTLP receiver, and each
request carries every header a client could force a trace with: a sampled ``traceparent``,
``x-client-trace-id`` (Envoy's client_sampling, 100% by default), ``x-envoy-force-trace`` and an
``x-request-id`` whose UUID carries the forced-trace bits (which Envoy keeps from an address it
deems internal). The rendered config removes them before Envoy reads them
(``extproc.adapters.envoy_config.filters.trace_forcing_headers``); before it did, the first test's 40
requests were all traced at 0%."""

from __future__ import annotations

import asyncio
import secrets
import uuid

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import SpanReceiver, chat, otlp_receiver, post

pytestmark = pytest.mark.e2e
ENVOY = "envoy-gateway"
REQUESTS = 40


def forcing_headers(trace_id: str) -> dict[str, str]:
    """Every header of a client that wants its request traced, under its own trace ``trace_id``."""
    request_id = list(str(uuid.uuid4()))
    request_id[14] = "b"  # Envoy's UUID trace status: forced
    return {
        "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
        "tracestate": "client=forced",
        "x-client-trace-id": secrets.token_hex(8),
        "x-envoy-force-trace": "true",
        "x-request-id": "".join(request_id),
    }


async def _send_forcing(gw: LocalGateway, n: int) -> set[str]:
    """``n`` requests with :func:`forcing_headers`: their client trace ids."""
    ids = {secrets.token_hex(16) for _ in range(n)}
    async with aiohttp.ClientSession() as http:
        for trace_id in ids:
            status, _, _ = await post(http, gw.url, chat("trace me"), forcing_headers(trace_id))
            assert status == 200
    await asyncio.sleep(6.0)  # Envoy's OTLP exporter flushes every 5 s
    return ids


def _ingress_traces(receiver: SpanReceiver) -> set[str]:
    return {s.trace_id for s in receiver.spans if s.service == ENVOY and s.name == "ingress"}


def _gateway(receiver: SpanReceiver, percent: float, client_parent: bool) -> LocalGateway:
    return LocalGateway(
        replicas=1,
        time_scale=0.02,
        tracing_collector=receiver.address,
        envoy_options={"tracing_sample_percent": percent, "tracing_client_parent": client_parent},
        processor_args=() if client_parent else ("--tracing-sampler=ratio",),
    )


async def test_a_client_forces_no_more_traces_than_envoys_percent_and_joins_none() -> None:
    """The processor's sampler ``ratio`` (the default) and Envoy at 25%: about a quarter of 40
    forcing requests are traced (a binomial count; 25 of 40 is over five deviations out), and no
    span anywhere is in a client's trace."""
    require_binary("envoy")
    with otlp_receiver() as receiver:
        with _gateway(receiver, 25.0, client_parent=False) as gw:
            client_ids = await _send_forcing(gw, REQUESTS)
        traced = _ingress_traces(receiver)
    print(f"\n{REQUESTS} requests forcing a trace, Envoy at 25%: {len(traced)} traced")
    assert not client_ids & {s.trace_id for s in receiver.spans}
    assert 1 <= len(traced) <= 25, len(traced)


async def test_with_the_parent_followed_a_client_joins_only_what_envoy_samples() -> None:
    """``tracing.sampler: parent_based`` keeps the client's trace context: Envoy at 0% still
    traces none of the forcing requests (its percent decides; a sampled parent is joined only
    when Envoy samples the request, as ``tests/e2e/test_tracing_e2e.py`` shows at 100%)."""
    require_binary("envoy")
    with otlp_receiver() as receiver:
        with _gateway(receiver, 0.0, client_parent=True) as gw:
            await _send_forcing(gw, 10)
        assert _ingress_traces(receiver) == set()
