"""Classes to pools and tenant quotas, through real Envoy, the processor and fake replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import SEED_CLASSES, as_tenant, chat, tenant_api_keys

pytestmark = pytest.mark.e2e
POOLS = {
    "replica-0": "short",
    "replica-1": "long",
    "replica-2": "multimodal",
    "replica-3": "batch",
    "replica-4": "overflow",
}


async def send(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, str, dict[str, str]]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-replica-name", ""), {k.lower(): v for k, v in resp.headers.items()}


async def test_classes_go_to_their_pools_and_a_noisy_tenant_gets_429(tmp_path: Path) -> None:
    require_binary("envoy")
    config = {
        "classes": SEED_CLASSES,
        "tenants": {
            "definitions": {"noisy": {"max_concurrent": 2, "retry_after_s": 2}},
            "api_keys": tenant_api_keys("noisy", "steady"),
        },
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    labels = {name: {"pool": pool} for name, pool in POOLS.items()}
    with LocalGateway(replicas=5, labels=labels, processor_args=("--config", str(tmp_path / "router.yaml"))) as gw:
        async with aiohttp.ClientSession() as http:
            image = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": "http://x/a"}}]
            cases = [
                (chat("a short question", max_tokens=4), {}, "short"),
                (chat("a long document " * 700, stream=True, max_tokens=4), {}, "long"),
                (chat(image, max_tokens=4), {}, "multimodal"),
                (chat("nightly summaries " * 20, max_tokens=4), {"x-request-class": "batch"}, "batch"),
            ]
            for body, headers, pool in cases:
                for i in range(3):
                    status, replica, _ = await send(http, gw.url, body, {**headers, "x-session-id": f"{pool}-{i}"})
                    assert status == 200 and POOLS[replica] == pool, (pool, replica)

            slow = chat(
                "a long prompt to keep the replica busy " * 150, max_tokens=4
            )  # ~1,500 tokens: 0.15 s of prefill each
            noisy = await asyncio.gather(
                *(send(http, gw.url, slow, {**as_tenant("noisy"), "x-session-id": f"n{i}"}) for i in range(8))
            )
            steady = await asyncio.gather(
                *(send(http, gw.url, chat(f"steady {i}", max_tokens=4), as_tenant("steady")) for i in range(4))
            )
            statuses = [s for s, _, _ in noisy]
            assert statuses.count(429) >= 4 and statuses.count(200) >= 2, statuses
            assert all(h.get("retry-after") == "2" for s, _, h in noisy if s == 429)
            assert all(s == 200 for s, _, _ in steady)  # the other tenant is unaffected
