"""``grpc.server: grpclib`` through real Envoy, beside grpcio's server on the same requests: the
ext_proc port served on the event loop routes, keeps conversations, reads and rewrites streamed
answers, and answers bad or large bodies as grpcio's does."""

from __future__ import annotations

import json

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import CHAT, chat, metrics_page, post, scrape_total

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("kind", ["grpcio", "grpclib"])
async def test_envoy_routes_through_either_grpc_server(kind: str) -> None:
    require_binary("envoy")
    args = (f"--grpc-server={kind}", "--admin-listen=off")
    with LocalGateway(replicas=3, time_scale=0.02, processor_args=args) as gw:
        async with aiohttp.ClientSession() as http:
            homes = set()
            for c in range(4):
                seen = set()
                for t in range(4):
                    turns = " ".join(f"turn {i}" for i in range(t + 1))
                    prompt = f"grpclib conversation {c} " + "context " * 150 + turns
                    status, replica, _ = await post(http, gw.url, chat(prompt), {"x-session-id": f"lib-{c}"})
                    assert status == 200
                    seen.add(replica)
                assert len(seen) == 1, seen  # each conversation stays where it started
                homes |= seen

            # The processor reads every stream's usage: it asks the replica for it and takes it out
            # again for a client that did not ask (a response body replaced as it passes).
            async def usage_seen(ask: bool) -> bool:
                body = chat(f"a streamed turn {ask} " * 40, stream=True)
                if ask:
                    body["stream_options"] = {"include_usage": True}
                async with http.post(gw.url + CHAT, json=body, headers={"x-session-id": f"lib-{ask}"}) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                assert "data: [DONE]" in text
                return '"completion_tokens"' in text

            assert await usage_seen(True) and not await usage_seen(False)
            for bad in (b"{not json", b""):
                status, replica, _ = await post(http, gw.url, bad, {"x-session-id": "lib-bad"})
                assert status == 400 and replica
            # Over grpcio's 4 MiB default message size, under Envoy's buffer: routed on the session.
            big = json.dumps(chat("y" * (5 * 1024 * 1024))).encode()
            status, replica, _ = await post(http, gw.url, big, {"x-session-id": "lib-big"})
            assert status == 200 and replica
            page = await metrics_page(http, gw.metrics_url)
    assert len(homes) > 1  # spread, not one replica for everything
    # Envoy fails open, so a processor that never answered would still give 200s: these show it decided.
    assert scrape_total(page, "extproc_decisions_total") >= 16 + 2 + 2 + 1
    assert scrape_total(page, "extproc_responses_observed_total") >= 16 + 2 + 1
