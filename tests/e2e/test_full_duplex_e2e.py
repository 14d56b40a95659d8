"""FULL_DUPLEX_STREAMED, the body mode of the Gateway API Inference Extension's gateways, through
real Envoy: the decision is held until the body is complete, and the body reaches the replica intact."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("mode", "server"), [("cluster", "grpcio"), ("endpoint", "grpcio"), ("endpoint", "grpclib")])
async def test_full_duplex_bodies_are_routed_and_arrive_intact(mode: str, server: str) -> None:
    require_binary("envoy")
    args = ("--grpc-server=grpclib", "--admin-listen=off") if server == "grpclib" else ()
    with LocalGateway(replicas=3, mode=mode, full_duplex=True, time_scale=0.02, processor_args=args) as gw:
        async with aiohttp.ClientSession() as http:

            async def turn(session: str, text: str) -> tuple[str, int]:
                body = {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
                async with http.post(
                    f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": session}
                ) as r:
                    assert r.status == 200, await r.text()
                    payload = json.loads(await r.read())
                    return r.headers["x-replica-name"], payload["usage"]["prompt_tokens"]

            async def converse(i: int) -> set[str]:
                seen = set()
                history = f"duplex conversation {i} " + "context " * 200
                for t in range(6):
                    history += f" turn {t}"
                    replica, _ = await turn(f"d{i}", history)
                    seen.add(replica)
                return seen

            results = await asyncio.gather(*(converse(i) for i in range(6)))
            assert all(len(s) == 1 for s in results)
            # A body of several streamed chunks (over 62 KiB) comes out whole: the replica counts it all.
            big = "x" * 300_000
            _, prompt_tokens = await turn("big", big)
            assert prompt_tokens >= 300_000 // 4
