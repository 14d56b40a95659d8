"""What a client sends cannot buy it more than its share: each attack of issue 39 through real
Envoy (the config ``extproc envoy-config`` renders), the processor and fake replicas, as a client
without privileges would make it. The engines' own counts are compared in
``tests/e2e/test_abuse_vllm_e2e.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from tests.conftest import require_binary
from tests.helpers import as_tenant, tenant_api_keys

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def charged(samples: dict[str, float], tenant: str) -> float:
    """Every token ``extproc_tokens_total`` holds for ``tenant``."""
    found = 0.0
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
        if name == "extproc_tokens_total" and pairs.get("tenant") == tenant:
            found += value
    return found


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
            assert charged(samples, "acme") == 0
            assert charged(samples, "other") > 0  # metered, as nobody's
            headers = {**as_tenant("acme"), "x-tenant-id": "beta"}
            async with http.post(gw.url + CHAT, json=chat("keyed"), headers=headers) as r:
                assert r.status == 200
            samples = await read_metrics(http, gw.metrics_url)
            assert charged(samples, "acme") > 0 and charged(samples, "beta") == 0
