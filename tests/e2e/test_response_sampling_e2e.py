"""health.response_sample_rate through real Envoy: the unsampled requests skip the response-headers
message (Envoy honours the processor's mode_override), stay routed and sticky, and keep their
in-flight slot until the request is over, because Envoy holds the ext_proc stream open till then."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import chat, metrics_page, post, scrape_total, wait_for

pytestmark = pytest.mark.e2e


async def metric(http: aiohttp.ClientSession, gw: LocalGateway, name: str) -> float:
    """The sum of every series of ``name`` on the processor's page."""
    return scrape_total(await metrics_page(http, gw.metrics_url), name)


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
            assert await metric(http, gw, "extproc_decisions_total") == 20
            assert await metric(http, gw, "extproc_responses_observed_total") == observed


async def test_an_unobserved_request_holds_its_in_flight_slot_until_it_ends() -> None:
    require_binary("envoy")
    with LocalGateway(replicas=1, time_scale=1.0, processor_args=("--response-sample-rate", "0")) as gw:
        body = chat("a long answer", max_tokens=300, min_tokens=300, ignore_eos=True)
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(post(http, gw.url, body))

            async def in_flight(n: int) -> bool:
                return await metric(http, gw, "extproc_replica_inflight_requests") == n

            # Routed, then held while generating (300 tokens, 1.5 s in the demo profile): read until
            # 1 s in, well before the answer ends.
            loop = asyncio.get_running_loop()
            held_until = loop.time() + 1.0
            await wait_for(lambda: in_flight(1), "the request in flight", within_s=1.0, step_s=0.02)
            while loop.time() < held_until:
                assert await in_flight(1) and not request.done()
                await asyncio.sleep(0.05)  # real time: a real request held in flight
            status, _, _ = await request
            # Envoy closes the ext_proc stream right after the response ends.
            await wait_for(lambda: in_flight(0), "the slot freed", within_s=3.0, step_s=0.05)
            assert status == 200
            assert await metric(http, gw, "extproc_responses_observed_total") == 0
