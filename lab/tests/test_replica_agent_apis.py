"""The fake replica's /v1/messages and /v1/responses, in the shapes vLLM 0.32 answers them
(its answers' shapes recorded from the engine here: usage, events, the 404 of an unknown or
unstored previous response)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import test_utils

from extproc.api import UsageTail, parse_usage
from extproc_lab.replica import ReplicaEngine, build_app, get_profile
from extproc_lab.replica.agent_apis import STORE_ENV

MODEL = "demo-model"
SYSTEM = "a long shared system prompt " * 40


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[test_utils.TestClient]:
    monkeypatch.setenv(STORE_ENV, "1")
    engine = ReplicaEngine(get_profile("demo", 0.01))
    server = test_utils.TestServer(build_app(engine, "replica-a", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(server) as c:
        yield c


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: ")
        out.append((kind[7:], json.loads(data[6:])))
    return out


async def test_messages_answers_and_usage_as_vllm(client: test_utils.TestClient) -> None:
    body = {"model": MODEL, "max_tokens": 3, "system": SYSTEM, "messages": [{"role": "user", "content": "hi"}]}
    first = await (await client.post("/v1/messages", json=body)).json()
    assert first["type"] == "message" and first["content"][0]["type"] == "text" and first["stop_reason"] == "max_tokens"
    u1 = first["usage"]
    assert u1["cache_read_input_tokens"] == 0 and u1["cache_creation_input_tokens"] > 0
    second = await (await client.post("/v1/messages", json=body)).json()
    u2 = second["usage"]
    prompt = u1["input_tokens"] + u1["cache_creation_input_tokens"]
    assert u2["cache_read_input_tokens"] == u1["cache_creation_input_tokens"] and u2["cache_creation_input_tokens"] == 0
    assert parse_usage(u2).input == prompt and parse_usage(u2).cached_input == u2["cache_read_input_tokens"]
    stream = await client.post("/v1/messages", json={**body, "stream": True})
    raw = await stream.read()
    kinds = [k for k, _ in events(raw)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_delta") == 3
    tail = UsageTail()
    tail.feed(raw)
    assert tail.usage() == parse_usage(u2)  # what the router meters from the stream's last usage
    bad = await client.post("/v1/messages", json={"model": MODEL, "messages": []})
    assert bad.status == 400


async def test_responses_previous_response_id_continues_the_stored_conversation(
    client: test_utils.TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": MODEL, "instructions": SYSTEM, "input": "tell me", "max_output_tokens": 4, "request_id": "resp_1"}
    first = await (await client.post("/v1/responses", json=body)).json()
    assert first["id"] == "resp_1" and first["status"] == "incomplete"
    assert first["output"][0]["content"][0]["type"] == "output_text"
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    follow = {"model": MODEL, "instructions": SYSTEM, "input": "more", "previous_response_id": "resp_1"}
    second = await (await client.post("/v1/responses", json={**follow, "max_output_tokens": 4})).json()
    u = second["usage"]
    # The stored conversation comes first: the first prompt's full blocks, all but its last, are cached.
    assert u["input_tokens"] > first["usage"]["input_tokens"]
    assert u["input_tokens_details"]["cached_tokens"] >= (first["usage"]["input_tokens"] // 16 - 1) * 16 > 0
    stream = await client.post("/v1/responses", json={**follow, "stream": True, "max_output_tokens": 2})
    raw = await stream.read()
    got = events(raw)
    assert got[0][0] == "response.created" and got[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    tail = UsageTail()
    tail.feed(raw)
    done = got[-1][1]["response"]["usage"]
    assert tail.usage() == parse_usage(done)
    missing = await client.post("/v1/responses", json={**follow, "previous_response_id": "resp_nope"})
    assert missing.status == 404 and "not found" in (await missing.json())["error"]["message"]


async def test_without_the_store_every_previous_response_is_a_404(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    engine = ReplicaEngine(get_profile("demo", 0.01))
    server = test_utils.TestServer(build_app(engine, "replica-a", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(server) as c:
        body = {"model": MODEL, "input": "x", "max_output_tokens": 2, "request_id": "resp_1"}
        assert (await c.post("/v1/responses", json=body)).status == 200
        again = await c.post("/v1/responses", json={**body, "previous_response_id": "resp_1"})
        assert again.status == 404
