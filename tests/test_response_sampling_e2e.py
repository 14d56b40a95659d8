"""health.response_sample_rate through real Envoy: the unsampled requests skip the response-headers
message (Envoy honours the processor's mode_override), stay routed and sticky, and keep their
in-flight slot until the request is over, because Envoy holds the ext_proc stream open till then."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.test_e2e import chat, post

pytestmark = pytest.mark.e2e


def metric(gw: LocalGateway, name: str) -> float:
    with urllib.request.urlopen(gw.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize(("rate", "observed"), [("0", 0), ("0.5", 10)])
async def test_sampled_requests_alone_send_response_headers_and_all_stay_sticky(rate: str, observed: int) -> None:
    require_binary("envoy")
    with LocalGateway(replicas=3, time_scale=0.02, processor_args=("--response-sample-rate", rate)) as gw:
        async with aiohttp.ClientSession() as http:
            seen = set()
            for turn in range(20):
                status, replica, _ = await post(http, gw.url, chat(f"turn {turn}"), {"x-session-id": "one"})
                assert status == 200
                seen.add(replica)
        assert len(seen) == 1
        assert metric(gw, "extproc_decisions_total") == 20
        assert metric(gw, "extproc_responses_observed_total") == observed


async def test_an_unobserved_request_holds_its_in_flight_slot_until_it_ends() -> None:
    require_binary("envoy")
    with LocalGateway(replicas=1, time_scale=1.0, processor_args=("--response-sample-rate", "0")) as gw:
        body = chat("a long answer", max_tokens=300, min_tokens=300, ignore_eos=True)
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(post(http, gw.url, body))
            await asyncio.sleep(0.5)  # routed, still generating (300 tokens, 1.5 s in the demo profile)
            during = await asyncio.to_thread(metric, gw, "extproc_replica_inflight_requests")
            status, _, _ = await request
        after = during
        for _ in range(40):  # Envoy closes the ext_proc stream right after the response ends
            after = await asyncio.to_thread(metric, gw, "extproc_replica_inflight_requests")
            if after == 0:
                break
            await asyncio.sleep(0.05)
        assert status == 200
        assert (during, after) == (1, 0)
        assert metric(gw, "extproc_responses_observed_total") == 0
