"""The fake replica in disaggregated serving: a prefill hop exports its blocks, a decode hop pulls
them (or recomputes when it cannot), failures injectable; the model's side of a transfer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import test_utils
from prometheus_client.parser import text_string_to_metric_families

from extproc_lab.replica import ReplicaEngine, ReplicaModel, Seq, build_app, get_profile
from extproc_lab.replica.kv_transfer import RemoteBlocks

MODEL = "demo-model"
FAST = 0.01
PROMPT = "".join(f"{i:04d}" + "x" * 60 for i in range(40))  # 40 full blocks of 16 tokens


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **extra}


def prefill_body() -> dict[str, Any]:
    """The prefill hop as vLLM's proxy sends it."""
    return body(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})


@contextlib.asynccontextmanager
async def replica(name: str) -> AsyncIterator[test_utils.TestClient]:
    engine = ReplicaEngine(get_profile("demo", FAST))
    server = test_utils.TestServer(build_app(engine, name, MODEL), host="127.0.0.1")
    async with test_utils.TestClient(server) as client:
        yield client


@pytest.fixture
async def pair() -> AsyncIterator[tuple[test_utils.TestClient, test_utils.TestClient]]:
    async with replica("prefill-0") as p, replica("decode-0") as d:
        yield p, d


def metric(page: str, name: str) -> float:
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


async def test_prefill_hop_answers_with_where_its_blocks_are(pair: Any) -> None:
    p, _ = pair
    resp = await p.post("/v1/chat/completions", json=prefill_body())
    assert resp.status == 200
    answer = await resp.json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.server.port)
    # The chat template adds a few tokens: at least the prompt's 40 blocks are offered.
    assert len(params["remote_block_ids"]) >= 40
    assert answer["usage"]["completion_tokens"] == 1


async def test_decode_hop_takes_the_blocks_as_cached_and_reports_them(pair: Any) -> None:
    p, d = pair
    params = (await (await p.post("/v1/chat/completions", json=prefill_body())).json())["kv_transfer_params"]
    resp = await d.post("/v1/chat/completions", json=body(max_tokens=4, kv_transfer_params=params))
    assert resp.status == 200
    usage = (await resp.json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16 * len(params["remote_block_ids"])
    page = (await (await d.get("/metrics")).read()).decode()
    assert metric(page, "vllm:prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
    state = await (await d.get("/kv_transfer")).json()
    assert state["fetched_blocks"] == len(params["remote_block_ids"]) and state["failed_fetches"] == 0


async def test_decode_hop_streams_too(pair: Any) -> None:
    p, d = pair
    params = (await (await p.post("/v1/chat/completions", json=prefill_body())).json())["kv_transfer_params"]
    resp = await d.post("/v1/chat/completions", json=body(max_tokens=3, stream=True, kv_transfer_params=params))
    assert resp.status == 200
    assert b"[DONE]" in await resp.read()
    assert (await (await d.get("/kv_transfer")).json())["fetched_blocks"] == len(params["remote_block_ids"])


async def test_a_decode_replica_fetches_only_the_blocks_it_lacks(pair: Any) -> None:
    p, d = pair
    await d.post("/v1/chat/completions", json=body(max_tokens=1))  # the decode replica holds it all
    params = (await (await p.post("/v1/chat/completions", json=prefill_body())).json())["kv_transfer_params"]
    await d.post("/v1/chat/completions", json=body(max_tokens=2, kv_transfer_params=params))
    assert (await (await d.get("/kv_transfer")).json())["fetched_blocks"] == 0


async def test_prefill_replica_gone_means_recompute() -> None:
    async with replica("decode-0") as d:
        async with replica("prefill-0") as p:
            params = (await (await p.post("/v1/chat/completions", json=prefill_body())).json())["kv_transfer_params"]
        resp = await d.post("/v1/chat/completions", json=body(max_tokens=2, kv_transfer_params=params))
        assert resp.status == 200
        assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        state = await (await d.get("/kv_transfer")).json()
        assert state["failed_fetches"] == 1 and state["fetched_blocks"] == 0


async def test_injected_faults(pair: Any) -> None:
    p, d = pair
    assert (await p.post("/kv_transfer/faults", json={"prefill": "fail"})).status == 200
    assert (await p.post("/v1/chat/completions", json=prefill_body())).status == 500
    assert (await p.post("/kv_transfer/faults", json={"prefill": "bogus"})).status == 400
    await p.post("/kv_transfer/faults", json={"prefill": "ok"})
    params = (await (await p.post("/v1/chat/completions", json=prefill_body())).json())["kv_transfer_params"]
    await d.post("/kv_transfer/faults", json={"fetch": "fail"})
    resp = await d.post("/v1/chat/completions", json=body(max_tokens=2, kv_transfer_params=params))
    assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await (await d.get("/kv_transfer")).json())["failed_fetches"] == 1


async def test_a_hanging_prefill_never_answers(pair: Any) -> None:
    p, _ = pair
    await p.post("/kv_transfer/faults", json={"prefill": "hang"})
    with pytest.raises(TimeoutError):
        async with p.post("/v1/chat/completions", json=prefill_body(), timeout=0.2):
            pass


def test_remote_blocks_parse_only_a_complete_decode_hop() -> None:
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_block_ids": [1, 2],
        "remote_host": "h",
        "remote_port": 1,
    }
    assert RemoteBlocks.parse(good) == RemoteBlocks("p", (1, 2), "h", 1)
    assert RemoteBlocks.parse({**good, "do_remote_prefill": False}) is None
    assert RemoteBlocks.parse({**good, "remote_block_ids": ["x"]}) is None
    assert RemoteBlocks.parse({"do_remote_decode": True}) is None
    assert RemoteBlocks.parse(None) is None


def test_model_receive_caches_free_blocks_and_stops_when_full() -> None:
    profile = replace(get_profile("demo"), num_gpu_blocks=8)
    model = ReplicaModel(profile)
    seq = Seq("a", 16 * 10, 1, keys=tuple(range(10)))
    assert model.missing_blocks(seq, 10) == 10
    assert model.receive(seq, 10) == 8  # the pool holds 8
    assert model.pool.used_blocks == 0 and len(model.pool) == 8  # cached, referenced by no one
    assert model.missing_blocks(seq, 10) == 2
    model.submit(seq, 0.0)
    model.begin_step(0.0)
    model.end_step()
    assert seq.cached_tokens == 0  # larger than the pool: computed without blocks, as the model does
    small = Seq("b", 16 * 4, 1, keys=(100, 101, 102, 103))
    fresh = ReplicaModel(profile)
    fresh.receive(small, 3)
    fresh.submit(small, 0.0)
    fresh.begin_step(0.0)
    fresh.end_step()
    assert small.cached_tokens == 48 and fresh.prefix_hits_tokens == 48
