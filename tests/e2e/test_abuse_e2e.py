"""What a client sends cannot buy it more than its share: each attack of issue 39 through real
Envoy (the config ``extproc envoy-config`` renders), the processor and fake replicas, as a client
without privileges would make it. The engines' own counts are compared in
``tests/e2e/test_abuse_vllm_e2e.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from extproc_lab.demo.processes import free_port
from extproc_lab.demo.redis_server import LocalRedis
from tests.conftest import require_binary
from tests.helpers import (
    abandon_after_first_chunk,
    as_tenant,
    charged_tokens,
    engine_tokens,
    settled,
    tenant_api_keys,
)

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def write_config(tmp_path: Path, config: dict[str, Any]) -> tuple[str, str]:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return ("--config", str(path))


@pytest.mark.parametrize("trust_header", [False, True], ids=["untrusted", "trusted-but-stripped"])
async def test_a_spoofed_tenant_header_charges_no_one_else(tmp_path: Path, trust_header: bool) -> None:
    """An anonymous client naming ``x-tenant-id: acme`` is not acme, and acme's key naming beta
    stays acme. Untrusted (the default) the processor ignores the header; trusted (a gateway's own
    authentication would set it) Envoy strips the client's before any filter."""
    require_binary("envoy")
    budgets = {"acme": {"per_day": 10**6}, "beta": {"per_day": 10**6}}
    config = {
        "budgets": {"enabled": True, "tenants": budgets},
        "tenants": {"api_keys": tenant_api_keys("acme", "beta"), "trust_header": trust_header},
    }
    with LocalGateway(replicas=2, processor_args=write_config(tmp_path, config)) as gw:
        async with aiohttp.ClientSession() as http:
            for i in range(6):
                async with http.post(gw.url + CHAT, json=chat(f"anon {i}"), headers={"x-tenant-id": "acme"}) as r:
                    assert r.status == 200, await r.text()
            samples = await read_metrics(http, gw.metrics_url)
            assert charged_tokens(samples, "acme") == 0
            assert charged_tokens(samples, "other") > 0  # metered, as nobody's
            headers = {**as_tenant("acme"), "x-tenant-id": "beta"}
            async with http.post(gw.url + CHAT, json=chat("keyed"), headers=headers) as r:
                assert r.status == 200
            samples = await read_metrics(http, gw.metrics_url)
            assert charged_tokens(samples, "acme") > 0 and charged_tokens(samples, "beta") == 0


PROMPT = " ".join(f"word{i % 97}" for i in range(400))  # 400 words, about 850 tokens by the estimate


async def test_streams_abandoned_after_the_first_chunk_are_charged_what_the_engines_computed(tmp_path: Path) -> None:
    """Six streams acme's key abandons after the first chunk (400-word prompts, max_tokens 200)
    were charged nothing before issue 39; now each is charged its prompt and the chunks seen,
    within the bound docs/tenancy.md states of what the replicas count."""
    require_binary("envoy")
    config = {
        "budgets": {"enabled": True, "tenants": {"acme": {"per_day": 10**7}}},
        "tenants": {"api_keys": tenant_api_keys("acme")},
    }
    with LocalGateway(replicas=2, processor_args=write_config(tmp_path, config)) as gw:
        async with aiohttp.ClientSession() as http:
            before = sum(await engine_tokens(http, gw))
            bodies = [chat(f"{i} {PROMPT}", max_tokens=200, stream=True) for i in range(6)]
            firsts = await asyncio.gather(
                *(abandon_after_first_chunk(http, gw.url + CHAT, b, as_tenant("acme")) for b in bodies)
            )
            assert all(f.startswith(b"data: ") for f in firsts)

            async def charged() -> float:
                return charged_tokens(await read_metrics(http, gw.metrics_url), "acme")

            async def computed() -> float:
                return sum(await engine_tokens(http, gw)) - before

            spent, engines = await settled(charged), await settled(computed)
            print(f"\nabandoned streams (fake replicas): charged {spent:.0f}, engines computed {engines:.0f}")
            assert spent > 0
            # The bound of docs/tenancy.md: within 10% of what the engines computed, and at most
            # 8 tokens a stream under it (output the engine made before it saw the client go).
            assert engines * 0.9 - 8 * len(bodies) <= spent <= engines * 1.1, (spent, engines)


async def test_bodies_over_the_limit_or_not_parsed_and_other_apis(tmp_path: Path) -> None:
    """A streamed body over ``max_body_bytes`` (never asked for its usage) is charged by its size
    and its chunks; a tenant without room for that estimate is refused before any replica; a body
    that does not parse is refused by the replica and charged nothing; other APIs refused by config
    never reach a replica."""
    require_binary("envoy")
    config = {
        "request": {"max_body_bytes": 4096},
        "budgets": {
            "enabled": True,
            "tenants": {"acme": {"per_day": 10**7}, "small": {"per_minute": 300}},
            "other_paths": "refuse",
        },
        "tenants": {"api_keys": tenant_api_keys("acme", "small")},
    }
    with LocalGateway(replicas=2, processor_args=write_config(tmp_path, config)) as gw:
        async with aiohttp.ClientSession() as http:

            async def charged(tenant: str) -> float:
                return charged_tokens(await read_metrics(http, gw.metrics_url), tenant)

            async def computed() -> float:
                return sum(await engine_tokens(http, gw))

            big = chat("many words " * 1200, max_tokens=16, stream=True)  # about 13 KB
            before = await computed()
            async with http.post(gw.url + CHAT, json=big, headers=as_tenant("acme")) as r:
                assert r.status == 200 and b'"usage"' not in await r.read()
            spent, engines = await settled(lambda: charged("acme")), await settled(computed) - before
            print(f"\nover max_body_bytes (fake replicas): charged {spent:.0f}, engines computed {engines:.0f}")
            assert engines * 0.9 <= spent <= engines * 1.1, (spent, engines)

            before = await computed()
            async with http.post(gw.url + CHAT, json=big, headers=as_tenant("small")) as r:
                assert r.status == 429 and "token budget" in await r.text()
            bad = {**as_tenant("small"), "content-type": "application/json"}
            async with http.post(gw.url + CHAT, data=b'{"model": "demo-model", "messages": [', headers=bad) as r:
                assert r.status == 400
            # The Messages and Responses APIs are read and metered as chat is; these are not.
            for path in ("/v1/embeddings", "/v1/audio/transcriptions", "/rerank"):
                async with http.post(gw.url + path, json={"model": "demo-model", "input": "x"}) as r:
                    assert r.status == 403 and "budgets.other_paths" in await r.text(), path
            await asyncio.sleep(0.5)  # real time: any request that got through would reach an engine by now
            assert await computed() == before  # none of them reached an engine
            assert await charged("small") == 0


async def test_two_workers_charge_one_count_per_budget(tmp_path: Path) -> None:
    """``--workers 2`` with a budget: with the memory store it does not start
    (tests/unit/adapters/server/test_workers.py); with Redis both workers charge one count, so a burst
    overshoots by what is in flight, never by a second budget (each worker counting apart would
    have admitted up to twice the limit)."""
    require_binary("envoy")
    require_binary("redis-server")
    limit, clients = 2000.0, 20
    config = {
        "budgets": {"enabled": True, "tenants": {"acme": {"per_day": limit}}},
        "tenants": {"api_keys": tenant_api_keys("acme")},
    }
    redis_port = free_port()
    args = (*write_config(tmp_path, config), "--workers", "2", "--store", f"redis://127.0.0.1:{redis_port}")
    gw = LocalGateway(replicas=2, processor_args=args)
    redis = LocalRedis(gw.procs, gw.dir, port=redis_port)
    try:
        redis.start()
        gw.start()
        charged: list[float] = []

        async def client(http: aiohttp.ClientSession, i: int) -> None:
            for j in range(20):
                body = chat(f"client {i} request {j}: " + "tell me about token budgets " * 5, max_tokens=4)
                async with http.post(gw.url + CHAT, json=body, headers=as_tenant("acme")) as r:
                    payload = await r.json()
                    if r.status != 200:
                        assert r.status == 429, payload
                        return
                    charged.append(float(payload["usage"]["prompt_tokens"] + payload["usage"]["completion_tokens"]))

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(client(http, i) for i in range(clients)))
        total, largest = sum(charged), max(charged)
        # Each worker sees the other's requests once charged: at most every client's request in
        # flight on the other worker, each up to the largest, on top of the limit.
        bound = clients * largest
        print(f"\ntwo workers, one budget: charged {total:.0f} of {limit:.0f} (overshoot bound {bound:.0f})")
        assert limit - largest <= total <= limit + bound < 2 * limit, (total, bound)
        log = (gw.dir / "processor.log").read_text()
        assert "budgets: the 2 workers charge one count per budget in the shared store" in log
    finally:
        gw.stop()
