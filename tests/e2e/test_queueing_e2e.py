"""Priority and fair queueing through real Envoy, with fake replicas held saturated (their /metrics
page switched to an overloaded one: KV 0.95, 50 waiting) while requests pile up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.fault_matrix import FaultyGateway
from tests.conftest import require_binary
from tests.helpers import as_tenant, tenant_api_keys, wait_for

pytestmark = pytest.mark.e2e

NAMES = ("replica-0", "replica-1")
PROMPT = "a long prompt to keep the replica busy " * 150  # ~1,500 tokens: about 0.15 s of prefill


def gateway(tmp_path: Path, queueing: dict[str, Any], wait_s: float, full_duplex: bool = False) -> FaultyGateway:
    config = {
        "classes": [{"name": "batch", "match": {"headers": {"x-request-class": "batch"}}}],
        "queueing": {"enabled": True, **queueing},
        "health": {"scrape_interval_s": 0.1},
        "tenants": {"api_keys": tenant_api_keys("x", "y", "a", "b")},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return FaultyGateway(
        replicas=len(NAMES),
        faulty=NAMES,
        processor_args=("--config", str(path)),
        envoy_options={"queue_wait_s": wait_s},
        full_duplex=full_duplex,
    )


def samples(page: str, name: str) -> dict[str, float]:
    out = {}
    for line in page.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def waiting(http: aiohttp.ClientSession, gw: FaultyGateway, priority: int) -> float:
    async with http.get(gw.metrics_url) as resp:
        page = await resp.text()
    return samples(page, "extproc_queue_waiting").get(f'extproc_queue_waiting{{priority="{priority}"}}', 0.0)


async def saturate(http: aiohttp.ClientSession, gw: FaultyGateway, mode: str) -> None:
    for name in NAMES:
        await asyncio.to_thread(gw.set_metrics_fault, name, mode)

    async def seen() -> bool:
        async with http.get(gw.metrics_url) as resp:
            page = await resp.text()
        queues = samples(page, "extproc_replica_queue")
        values = [v for k, v in queues.items() if any(f'"{n}"' in k for n in NAMES)]
        full = len(values) == len(NAMES) and all(v >= 50 for v in values)
        return full if mode == "overloaded" else len(values) == len(NAMES) and all(v < 50 for v in values)

    await wait_for(seen, within_s=15.0, step_s=0.05)


class Client:
    """Sends requests and notes when each one was answered."""

    def __init__(self, http: aiohttp.ClientSession, gw: FaultyGateway) -> None:
        self.http = http
        self.gw = gw
        self.done: list[tuple[float, str]] = []

    async def send(self, name: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
        body = {"model": "demo-model", "messages": [{"role": "user", "content": f"{name} {PROMPT}"}], "max_tokens": 2}
        async with self.http.post(f"{self.gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
            await resp.read()
            self.done.append((time.monotonic(), name))
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}

    def order(self) -> list[str]:
        return [name for _, name in sorted(self.done)]


async def test_interactive_goes_first_and_tenants_share_dispatch(tmp_path: Path) -> None:
    require_binary("envoy")
    queueing = {
        "max_inflight_per_replica": 1,
        "default": {"max_wait_s": 30},
        "classes": {"batch": {"priority": 0, "max_wait_s": 30}},
    }
    with gateway(tmp_path, queueing, wait_s=30) as gw:
        async with aiohttp.ClientSession() as http:
            client = Client(http, gw)
            await saturate(http, gw, "overloaded")
            batch = [
                asyncio.create_task(client.send(f"batch-{i}", {"x-request-class": "batch", **as_tenant("x")}))
                for i in range(8)
            ]
            await wait_for(lambda: _at_least(http, gw, 0, 8), within_s=15.0, step_s=0.05)
            interactive = [asyncio.create_task(client.send(f"chat-{i}", {**as_tenant("y")})) for i in range(4)]
            await wait_for(lambda: _at_least(http, gw, 1, 4), within_s=15.0, step_s=0.05)
            await saturate(http, gw, "ok")
            results = await asyncio.gather(*batch, *interactive)
            assert all(status == 200 for status, _ in results)
            order = client.order()
            last_chat = max(order.index(f"chat-{i}") for i in range(4))
            # Dispatched interactive first: with two requests in flight at a time, at most one batch
            # request (released as the last interactive one was) can finish before it.
            assert sum(name.startswith("batch") for name in order[:last_chat]) <= 1, order

            # Two tenants of one priority: "a" queued all of its requests before "b" did.
            client.done.clear()
            await saturate(http, gw, "overloaded")
            a = [
                asyncio.create_task(client.send(f"a-{i}", {"x-request-class": "batch", **as_tenant("a")}))
                for i in range(20)
            ]
            await wait_for(lambda: _at_least(http, gw, 0, 20), within_s=15.0, step_s=0.05)
            b = [
                asyncio.create_task(client.send(f"b-{i}", {"x-request-class": "batch", **as_tenant("b")}))
                for i in range(20)
            ]
            await wait_for(lambda: _at_least(http, gw, 0, 40), within_s=15.0, step_s=0.05)
            await saturate(http, gw, "ok")
            results = await asyncio.gather(*a, *b)
            assert all(status == 200 for status, _ in results)
            first_half = client.order()[:20]
            share = sum(name.startswith("a-") for name in first_half) / len(first_half)
            assert 0.4 <= share <= 0.6, client.order()


async def _at_least(http: aiohttp.ClientSession, gw: FaultyGateway, priority: int, n: int) -> bool:
    return await waiting(http, gw, priority) >= n


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_wait_past_the_limit_gets_429_and_a_departed_client_frees_its_place(
    tmp_path: Path, full_duplex: bool
) -> None:
    require_binary("envoy")
    queueing = {
        "default": {"max_wait_s": 1.0, "retry_after_s": 3},
        "classes": {"batch": {"priority": 0, "max_wait_s": 10}},
    }
    with gateway(tmp_path, queueing, wait_s=10, full_duplex=full_duplex) as gw:
        async with aiohttp.ClientSession() as http:
            client = Client(http, gw)
            await saturate(http, gw, "overloaded")
            start = time.monotonic()
            status, headers = await client.send("late", {})
            assert status == 429 and headers.get("retry-after") == "3"
            assert 0.9 <= time.monotonic() - start < 5

            gone = asyncio.create_task(client.send("gone", {"x-request-class": "batch"}))
            await wait_for(lambda: _at_least(http, gw, 0, 1), within_s=15.0, step_s=0.05)
            gone.cancel()  # the client closes its connection: Envoy ends the ext_proc stream
            await asyncio.gather(gone, return_exceptions=True)

            async def left() -> bool:
                return await waiting(http, gw, 0) == 0

            await wait_for(left, within_s=5, step_s=0.05)  # well before its 10 s limit
            async with http.get(gw.metrics_url) as resp:
                page = await resp.text()
            outcomes = samples(page, "extproc_queue_outcomes_total")
            assert outcomes.get('extproc_queue_outcomes_total{outcome="gone",request_class="batch"}') == 1.0, outcomes
            assert outcomes.get('extproc_queue_outcomes_total{outcome="timeout",request_class="default"}') == 1.0


async def test_requests_held_when_the_processor_restarts_are_not_lost(tmp_path: Path) -> None:
    """Envoy fails open (failure_mode_allow): a held request whose ext_proc stream breaks goes down
    the default route, round robin over the replicas, and is answered."""
    require_binary("envoy")
    queueing = {"default": {"max_wait_s": 20}}
    with gateway(tmp_path, queueing, wait_s=20) as gw:
        async with aiohttp.ClientSession() as http:
            client = Client(http, gw)
            await saturate(http, gw, "overloaded")
            held = [asyncio.create_task(client.send(f"held-{i}", {})) for i in range(6)]
            await wait_for(lambda: _at_least(http, gw, 1, 6), within_s=15.0, step_s=0.05)
            start = time.monotonic()
            await asyncio.to_thread(gw.procs.stop, gw.processor_name(0))
            results = await asyncio.wait_for(asyncio.gather(*held), timeout=10)
            assert all(status == 200 for status, _ in results), results
            assert time.monotonic() - start < 10
            await asyncio.to_thread(gw.start_processor, 0)
            await saturate(http, gw, "ok")
            status, _ = await client.send("after", {})
            assert status == 200
