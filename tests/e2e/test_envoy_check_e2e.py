"""A processor behind an Envoy whose ext_proc filter cannot let it route says so within 10 s of
traffic: an ERROR log line, ``extproc_config_problem{kind}`` at 1, and its ext_proc service
NOT_SERVING on the gRPC health check (the readiness probe)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.server.app import SERVICE_NAME
from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e

BUFFERED = "request_body_mode: BUFFERED"


def body_mode_none(rendered: str) -> str:
    """The rendered gateway with its ext_proc filter sending no request body."""
    assert rendered.count(BUFFERED) == 1
    return rendered.replace(BUFFERED, "request_body_mode: NONE")


def metric(url: str, line_start: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return None


async def serving(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    return int(reply.status)


async def test_a_filter_that_sends_no_body_is_reported_within_10_s() -> None:
    require_binary("envoy")
    problem = 'extproc_config_problem{kind="no_request_body"}'
    with LocalGateway(replicas=2, time_scale=0.05, envoy_yaml_edit=body_mode_none) as gw:
        address = gw.processor_addresses[0]
        assert await serving(address) == health_pb2.HealthCheckResponse.SERVING
        assert metric(gw.metrics_url, problem) == 0.0
        started = time.monotonic()
        reported = None
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - started < 10:
                body = {
                    "model": "demo-model",
                    "messages": [{"role": "user", "content": "hello " * 50}],
                    "max_tokens": 2,
                }
                async with http.post(f"{gw.url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200  # served: Envoy's default route, unrouted
                    await r.read()
                log = (gw.dir / "processor.log").read_text()
                if (
                    metric(gw.metrics_url, problem) == 1.0
                    and "ext_proc configuration problem no_request_body" in log
                    and await serving(address) == health_pb2.HealthCheckResponse.NOT_SERVING
                ):
                    reported = time.monotonic() - started
                    break
                await asyncio.sleep(0.2)  # real time: the real processor's check runs each second
        assert reported is not None, gw.procs.log_tail("processor")
        assert reported < 10
        print(f"misconfiguration reported {reported:.1f} s after the first request")
        # What the problem cost: nothing was routed.
        assert (metric(gw.metrics_url, 'extproc_decisions_total{model="demo-model",reason="sticky"}') or 0) == 0
        assert "ERROR" in (gw.dir / "processor.log").read_text()
