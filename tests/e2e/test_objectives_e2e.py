"""Routing to a latency objective through real Envoy: once the latency models are warm, a class
that sheds gets 429 with Retry-After where no replica is predicted to meet its objective (its
class's default, or its own header's where stricter: a client cannot loosen its class's objective
unless the class allows it), and the router reports attainment, sheds and prediction error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import CHAT, chat, scrape, scrape_total, wait_for

pytestmark = pytest.mark.e2e

CONFIG = {
    "classes": [
        {"name": "premium", "match": {"headers": {"x-tier": "premium"}}, "objectives": {"ttft_ms": 0.001}},
        {
            "name": "relaxed",
            "match": {"headers": {"x-tier": "relaxed"}},
            "objectives": {"ttft_ms": 0.001, "loosen": True},
        },
    ],
    "queueing": {
        "default": {"on_miss": "shed", "retry_after_s": 4},
        "classes": {"premium": {"on_miss": "shed"}, "relaxed": {"on_miss": "shed"}},
    },
}


async def send(http: aiohttp.ClientSession, gw: LocalGateway, text: str, **headers: str) -> tuple[int, str, str]:
    async with http.post(gw.url + CHAT, json=chat(text, max_tokens=4), headers=headers) as resp:
        body = await resp.text()
        return resp.status, resp.headers.get("retry-after", ""), body


async def page(http: aiohttp.ClientSession, gw: LocalGateway) -> str:
    async with http.get(gw.metrics_url) as resp:
        return await resp.text()


async def test_a_shedding_class_is_refused_when_every_replica_is_predicted_to_miss(tmp_path: Path) -> None:
    require_binary("envoy")
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(CONFIG))
    with LocalGateway(replicas=2, time_scale=0.05, processor_args=("--config", str(tmp_path / "router.yaml"))) as gw:
        async with aiohttp.ClientSession() as http:
            # Cold models decide nothing: an objective nobody could meet is routed as today.
            assert (await send(http, gw, "cold", **{"x-slo-ttft-ms": "0.001"}))[0] == 200

            async def warm() -> bool:
                text = await page(http, gw)
                return all(
                    scrape(
                        text, "extproc_latency_prediction_error", replica=f"replica-{i}", latency="ttft", quantile="0.9"
                    )
                    is not None
                    for i in range(2)
                )

            # Warm both replicas' models (32 observations each). A non-streamed answer teaches its
            # time to first token once the replica's engine has reported its inter-token gap (its
            # /metrics, scraped every 0.25 s): batches far apart enough for scrapes in between.
            for batch in range(60):
                results = await asyncio.gather(*(send(http, gw, f"warm {batch} {i}") for i in range(10)))
                assert all(status == 200 for status, _, _ in results)
                if await warm():
                    break
                await asyncio.sleep(0.1)  # real time: real engines warming the latency models
            await wait_for(warm, within_s=15.0, step_s=0.1)
            status, retry_after, body = await send(http, gw, "too tight", **{"x-slo-ttft-ms": "0.001"})
            assert (status, retry_after) == (429, "4") and '"objective"' in body
            status, retry_after, _ = await send(http, gw, "premium default", **{"x-tier": "premium"})
            assert (status, retry_after) == (429, "1")
            # A client's looser header is ignored: a class that sheds stays shed (issue 39)...
            loose = await send(http, gw, "loosened", **{"x-tier": "premium", "x-slo-ttft-ms": "60000"})
            assert loose[:2] == (429, "1")
            # ...unless the class allows it: then an objective in reach is served.
            assert (await send(http, gw, "in reach", **{"x-tier": "relaxed", "x-slo-ttft-ms": "60000"}))[0] == 200
            text = await page(http, gw)
            assert scrape_total(text, "extproc_requests_shed_total", **{"class": "default", "reason": "objective"}) == 1
            assert scrape_total(text, "extproc_requests_shed_total", **{"class": "premium", "reason": "objective"}) == 2

            async def judged() -> bool:
                text = await page(http, gw)
                return (
                    scrape_total(text, "extproc_objective_requests_total", **{"class": "relaxed", "outcome": "met"})
                    == 1
                )

            await wait_for(judged, within_s=10.0, step_s=0.1)
            text = await page(http, gw)
            # The cold request's 0.001 ms was judged too: missed.
            assert (
                scrape_total(text, "extproc_objective_requests_total", **{"class": "default", "outcome": "missed"}) == 1
            )
