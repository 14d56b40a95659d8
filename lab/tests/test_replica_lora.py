"""LoRA adapters in the fake replica: slots with LRU swapping, 404s, /v1/models and the
``vllm:lora_requests_info`` line as the router's parser reads it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientSession, test_utils

from extproc.api import parse_vllm_metrics
from extproc_lab.replica import REPLICA_HEADER, ReplicaEngine, build_app, get_profile, serve_replica
from extproc_lab.replica.lora import LoraSlots

MODEL = "demo-model"
FAST = 0.01


def body(model: str, text: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


async def make_client(lora: LoraSlots | None) -> test_utils.TestClient:
    engine = ReplicaEngine(get_profile("demo", FAST))
    server = test_utils.TestServer(build_app(engine, "replica-l", MODEL, lora), host="127.0.0.1")
    client = test_utils.TestClient(server)
    await client.start_server()
    return client


@pytest.fixture
async def two_slots() -> AsyncIterator[test_utils.TestClient]:
    client = await make_client(LoraSlots(2, ["a", "b"]))
    try:
        yield client
    finally:
        await client.close()


async def lora_info(client: test_utils.TestClient) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    info = parse_vllm_metrics(await resp.text()).lora
    assert info is not None
    return info.max_lora, info.running, info.waiting


def test_slots_swap_least_recently_used() -> None:
    now = [100.0]
    slots = LoraSlots(2, ["a", "b", "c"], clock=lambda: now[0])
    assert slots.loaded == ("a", "b") and slots.known == {"a", "b", "c"}
    assert slots.use("a")  # a is now the most recent
    now[0] = 105.0
    assert slots.use("c")  # known, swapped in: b was least recently used
    assert slots.loaded == ("a", "c") and slots.evictions == 1 and slots.updated_at == 105.0
    assert slots.use("z")  # on demand (as with a LoRA resolver): loaded by name, a goes
    assert slots.loaded == ("c", "z")
    assert not slots.use("x,y") and not slots.use("")


def test_slots_without_on_demand_refuse_unknown_names() -> None:
    slots = LoraSlots(1, ["a", "b"], on_demand=False)
    assert slots.loaded == ("a",)
    assert slots.use("b") and slots.loaded == ("b",)  # known: swapped in
    assert not slots.use("zzz") and slots.loaded == ("b",)


def test_slots_reject_bad_sizes() -> None:
    with pytest.raises(ValueError):
        LoraSlots(0, ["a"])
    with pytest.raises(ValueError):
        LoraSlots(-1)
    assert LoraSlots(0).exposition() == ""


def test_exposition_line_parses_and_escapes() -> None:
    slots = LoraSlots(3, ["sql-lora", 'we"ird'], clock=lambda: 1700000000.5)
    text = slots.exposition()
    assert 'vllm:lora_requests_info{max_lora="3",running_lora_adapters="sql-lora,we\\"ird"' in text
    assert "model_name" not in text
    page = 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n' + text
    info = parse_vllm_metrics(page).lora
    assert info is not None and info.running == ("sql-lora", 'we"ird') and info.max_lora == 3


async def test_loaded_adapter_is_served_and_listed(two_slots: test_utils.TestClient) -> None:
    before = time.time()
    assert await lora_info(two_slots) == (2, ("a", "b"), ())
    resp = await two_slots.post("/v1/chat/completions", json=body("a"))
    assert resp.status == 200
    payload = await resp.json()
    assert payload["model"] == "a" and resp.headers[REPLICA_HEADER] == "replica-l"
    resp = await two_slots.post("/v1/chat/completions", json=body(MODEL))  # the base model too
    assert resp.status == 200
    models = await (await two_slots.get("/v1/models")).json()
    ids = {m["id"]: m["parent"] for m in models["data"]}
    assert ids == {MODEL: None, "a": MODEL, "b": MODEL}
    page = await (await two_slots.get("/metrics")).text()
    line = next(x for x in page.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="a,b"' in line and 'waiting_lora_adapters=""' in line
    assert before - 60 < float(line.rsplit(" ", 1)[1]) <= time.time()  # the update time
    assert parse_vllm_metrics(page).models == (MODEL,)


async def test_unknown_adapter_evicts_the_least_recently_used(two_slots: test_utils.TestClient) -> None:
    assert (await two_slots.post("/v1/chat/completions", json=body("a"))).status == 200  # b is now LRU
    resp = await two_slots.post("/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 2})
    assert resp.status == 200
    assert await lora_info(two_slots) == (2, ("a", "c"), ())
    assert (await two_slots.post("/v1/chat/completions", json=body("b"))).status == 200  # swapped back, a goes
    assert await lora_info(two_slots) == (2, ("b", "c"), ())


async def test_unresolvable_adapter_is_a_404_like_vllm() -> None:
    client = await make_client(LoraSlots(2, ["a"], on_demand=False))
    try:
        resp = await client.post("/v1/chat/completions", json=body("nope"))
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert error["type"] == "NotFoundError" and "nope" in error["message"]
        assert await lora_info(client) == (2, ("a",), ())
    finally:
        await client.close()


async def test_without_lora_any_model_is_served_and_no_lora_line() -> None:
    client = await make_client(None)
    try:
        assert (await client.post("/v1/chat/completions", json=body("whatever"))).status == 200
        page = await (await client.get("/metrics")).text()
        assert "lora_requests_info" not in page and parse_vllm_metrics(page).lora is None
    finally:
        await client.close()


async def test_serve_replica_with_adapters() -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    task = asyncio.create_task(
        serve_replica("replica-s", "127.0.0.1", 0, "instant", ready=ready, lora_adapters=("x", "y"), max_lora=3)
    )
    try:
        port = await asyncio.wait_for(ready, 5)
        async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            info = parse_vllm_metrics(await resp.text()).lora
        assert info is not None and info.max_lora == 3 and info.running == ("x", "y")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_serve_replica_rejects_adapters_without_slots() -> None:
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(ValueError):
        await serve_replica("replica-s", "127.0.0.1", 0, "instant", ready=ready, lora_adapters=("x",), max_lora=0)
    with pytest.raises(ValueError):
        ready.result()
