"""The Messages and Responses APIs through real Envoy and the router on fake replicas that serve them
as vLLM does (``extproc_lab.replica.agent_apis``): Responses turns chained by
``previous_response_id`` with no session key all reach the one replica that stores their
conversation (anywhere else is a 404), keyless Messages conversations stay on their replica, and
an agent's own session header is its session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.replica import REPLICA_HEADER
from extproc_lab.replica.agent_apis import STORE_ENV
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
MODEL = "demo-model"
SYSTEM = "You are an agent in a shared harness with a long common prompt. " * 30


@pytest.fixture(scope="module")
def gateway() -> Iterator[LocalGateway]:
    require_binary("envoy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, "1")  # the fake replicas keep answers, as vLLM with the store on
        with LocalGateway(replicas=3, time_scale=0.02) as gw:
            yield gw


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> tuple[str, Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        return resp.headers[REPLICA_HEADER], await resp.json()


async def test_previous_response_id_turns_reach_the_replica_that_stores_them(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:

        async def chain(i: int) -> set[str]:
            seen, previous = set(), None
            for turn in range(5):
                # Each agent its own instructions: new chains spread, so a turn sent anywhere but
                # its chain's replica would find no stored conversation there (a 404).
                body: dict[str, Any] = {"model": MODEL, "instructions": f"agent {i}: " + SYSTEM, "max_output_tokens": 4}
                body["input"] = f"step {turn}"
                if previous is not None:
                    body["previous_response_id"] = previous
                replica, answer = await _post(http, gateway.url + "/v1/responses", body)
                seen.add(replica)
                previous = answer["id"]
            return seen

        chains = await asyncio.gather(*(chain(i) for i in range(9)))
    assert all(len(c) == 1 for c in chains), chains
    assert len(set().union(*chains)) > 1, chains  # the chains themselves spread


async def test_keyless_messages_conversations_and_agent_sessions_stay(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:

        async def converse(i: int, headers: dict[str, str]) -> set[str]:
            seen = set()
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {i}: fix the build"}]
            for turn in range(4):
                body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": messages}
                replica, answer = await _post(http, gateway.url + "/v1/messages", body, **headers)
                seen.add(replica)
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": [{"type": "text", "text": f"turn {turn} result"}]},
                ]
            return seen

        keyless = await asyncio.gather(*(converse(i, {}) for i in range(6)))
        agents = await asyncio.gather(*(converse(100 + i, {"x-claude-code-session-id": f"cc-{i}"}) for i in range(6)))
    assert all(len(c) == 1 for c in keyless), keyless
    assert all(len(c) == 1 for c in agents), agents
