"""Token metering and budgets through real Envoy, the processor and fake replicas: streams reach
the client as the replica sent them whether or not it asked for usage, a tenant over its token
budget is refused within one request of crossing it while another tenant is served, an API key
over its own budget is refused while its tenant has room, and the tokens every response reported
are in /metrics (``extproc_tokens_total``) and in the usage export (``extproc admin usage``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.state.budgets import window_start
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from tests.conftest import require_binary
from tests.helpers import as_tenant, tenant_api_keys, wait_for

pytestmark = pytest.mark.e2e
VOLATILE = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


KEY = "sk-e2e-metered-key"


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], tenant: str, key: str | None = None
) -> tuple[int, bytes, Any]:
    headers = {**as_tenant(tenant), "x-session-id": f"{tenant}-s"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"  # the key's tenant: keyed
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.read(), resp.headers


def usage_of(raw: bytes) -> dict[str, int]:
    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return next(json.loads(e)["usage"] for e in reversed(events) if b'"usage"' in e)


async def test_streams_are_unchanged_and_a_tenant_over_its_budget_is_refused(tmp_path: Path) -> None:
    require_binary("envoy")
    tenants = {
        "acme": {"per_minute": 400, "per_day": 10**6},
        "streamer": {"per_minute": 400},
        "other": {"per_minute": 10**6},
        "keyed": {"per_minute": 10**6},
    }
    keys = {"bot": {"per_minute": 100, "sha256": hashlib.sha256(KEY.encode()).hexdigest()}}
    api_keys = {**tenant_api_keys(*tenants), hashlib.sha256(KEY.encode()).hexdigest(): "keyed"}
    config = {"budgets": {"enabled": True, "tenants": tenants, "keys": keys}, "tenants": {"api_keys": api_keys}}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    with LocalGateway(replicas=1, processor_args=("--config", str(tmp_path / "router.yaml"))) as gw:
        direct = f"http://{gw.members[0].address}"
        async with aiohttp.ClientSession() as http:
            # A stream whose client did not ask for usage: the router asks, and takes the chunk out.
            body = chat("tell me a story about caches", stream=True)
            status, through, _ = await post(http, gw.url, body, "other")
            _, replica, _ = await post(http, direct, body, "other")
            assert status == 200 and b'"usage"' not in through
            assert VOLATILE.sub(b"", through) == VOLATILE.sub(b"", replica)
            # A client that asked gets the chunk, as the replica sent it.
            asked = chat("tell me a story about caches", stream=True, stream_options={"include_usage": True})
            _, through, _ = await post(http, gw.url, asked, "other")
            _, replica, _ = await post(http, direct, asked, "other")
            assert VOLATILE.sub(b"", through) == VOLATILE.sub(b"", replica)
            assert usage_of(through)["completion_tokens"] == 8

            # acme: 400 weighted tokens a minute. Each request is charged what its response reports.
            charged, last, reported = 0.0, 0.0, {"prompt": 0, "completion": 0}
            for i in range(30):
                status, raw, headers = await post(http, gw.url, chat(f"question {i} " * 20), "acme")
                if status == 429:
                    assert int(headers["retry-after"]) >= 1
                    assert headers["x-ratelimit-limit-tokens"] == "400"
                    assert json.loads(raw)["error"]["type"] == "tokens_exceeded"
                    break
                assert status == 200
                # An admitted answer carries the budget's standing as OpenAI's do.
                assert headers["x-ratelimit-limit-tokens"] == "400", dict(headers)
                assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < 400 - charged
                usage = json.loads(raw)["usage"]
                reported["prompt"] += usage["prompt_tokens"]
                reported["completion"] += usage["completion_tokens"]
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                last = usage["prompt_tokens"] - cached + 0.25 * cached + usage["completion_tokens"]
                charged += last
            else:
                pytest.fail("never refused")
            # Within one request of crossing: admitted while under the limit, refused once over
            # what the next request's prompt estimate (about 60 tokens) would leave.
            assert charged - last < 400 and charged > 400 - 100, (charged, last)
            # A streaming tenant whose client never asks for usage is charged all the same.
            streams = 0
            for i in range(30):
                status, raw, _ = await post(http, gw.url, chat(f"streamed {i} " * 20, stream=True), "streamer")
                if status == 429:
                    break
                assert b'"usage"' not in raw
                streams += 1
            else:
                pytest.fail("the streams were never charged")
            status, _, _ = await post(http, gw.url, chat("and another tenant"), "other")
            assert status == 200

            # An API key with 100 tokens a minute: refused once spent, its tenant still served.
            for i in range(10):
                status, raw, headers = await post(http, gw.url, chat(f"key question {i} " * 10), "keyed", KEY)
                if status == 429:
                    break
                assert status == 200
            else:
                pytest.fail("the key was never refused")
            assert i >= 1 and "API key's token budget" in json.loads(raw)["error"]["message"]
            assert headers["x-ratelimit-limit-tokens"] == "100" and int(headers["retry-after"]) >= 1
            status, _, _ = await post(http, gw.url, chat("key question " * 10), "keyed")
            assert status == 200
            keyed_at = time.time()  # the key's last charge is in (it precedes the body's end)

            # What the responses reported is what /metrics counts (the last body piece is answered
            # after the charge, so the counters are there once the client has the body).
            samples = await read_metrics(http, gw.metrics_url)

            def tokens(tenant: str, *kinds: str) -> float:
                found = 0.0
                for key, value in samples.items():
                    name, _, labels = key.partition("{")
                    pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
                    if name == "extproc_tokens_total" and pairs["tenant"] == tenant and pairs["kind"] in kinds:
                        found += value
                return found

            assert tokens("acme", "input", "cached_input") == reported["prompt"]
            assert tokens("acme", "output") == reported["completion"]
            assert tokens("streamer", "output") == 8 * streams
            digest = hashlib.sha256(KEY.encode()).hexdigest()
            assert not any(KEY in k or digest in k for k in samples)  # never the key, nor its digest

            # Each budget's standing, as the dashboards read it (reported every few seconds; the
            # day's window, which a slow run does not see roll over as it may the minute's).
            spent = "extproc_budget_remaining_tokens{kind=tenant,name=acme,window=day}"

            async def acme_spent() -> bool:
                return (await read_metrics(http, gw.metrics_url)).get(spent, 10**6) <= 10**6 - charged + 1

            await wait_for(acme_spent, "acme's remaining budget in /metrics", within_s=12, step_s=0.5)
            limit = "extproc_budget_limit_tokens{kind=key,name=bot,window=minute}"
            assert (await read_metrics(http, gw.metrics_url))[limit] == 100.0

        # The usage export: the same counts, from the processor's admin API (its ext_proc port).
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "admin", "--server", gw.admin_addresses[0], "usage", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        export = json.loads(out)
        acme = [row for row in export["usage"] if row["tenant"] == "acme"]
        assert sum(r["input_tokens"] + r["cached_input_tokens"] for r in acme) == reported["prompt"]
        assert sum(r["output_tokens"] for r in acme) == reported["completion"]
        (bot,) = (b for b in export["budgets"] if b["kind"] == "key")
        assert bot["name"] == "bot" and bot["windows"][0]["window"] == "minute"
        # The minute's window is the clock's: if a minute began since the key's charges, it is empty.
        if window_start(60, keyed_at) == window_start(60, time.time()):
            assert bot["windows"][0]["used"] > 0, bot
