"""Envoy's access log as `extproc envoy-config --access-log` renders it, through real Envoy: a JSON
line a request, where its time went before the replica answered, nothing of what the client said."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e

SECRET = "conversation-secret-7f3a"


async def test_a_request_logs_its_times_and_the_processors_share_and_no_secret(tmp_path: Path) -> None:
    require_binary("envoy")
    log = tmp_path / "access.jsonl"
    with LocalGateway(replicas=2, time_scale=0.02, envoy_options={"access_log": str(log)}) as gw:
        body = {
            "model": "demo-model",
            "messages": [{"role": "user", "content": SECRET + " please"}],
            "max_tokens": 4,
            "stream": True,
        }
        # A client's own request id, made to break a line that did not escape it.
        headers = {"x-session-id": SECRET, "x-request-id": 'a"b\\c', "authorization": f"Bearer {SECRET}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                answered_by = r.headers["x-replica-name"]
                await r.read()
            async with http.post(f"{gw.round_robin_url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
        replica = next(m for m in gw.members if m.name == answered_by)
    # Read once Envoy has stopped: it writes its log to the file every 10 s, and as it exits.
    ours, direct = (json.loads(line) for line in log.read_text().splitlines())
    assert SECRET not in log.read_text()
    assert ours["status"] == 200 and ours["path"] == "/v1/chat/completions" and ours["upstream"] == replica.address
    # The body came, then the processor answered, then the request left for the replica, which
    # answered after it.
    assert 0 <= ours["received_us"] <= ours["upstream_sent_us"] <= ours["upstream_answered_us"]
    waited = {k: int(v) for k, v in ours.items() if k.startswith("ext_proc_")}  # filter state: strings
    assert waited["ext_proc_request_header_latency_us"] > 0 and waited["ext_proc_request_body_total_latency_us"] > 0
    assert waited["ext_proc_response_header_latency_us"] > 0
    # The round-robin listener has no processor, so no processor fields.
    assert direct["status"] == 200 and not any(k.startswith("ext_proc_") for k in direct)
