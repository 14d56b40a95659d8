"""KV room on a real vLLM engine (``queueing.kv_room``), through real Envoy: the engine's KV size
is read from its /metrics, a streamed answer holds its room until its stream ends (vLLM sends the
headers before the first token), a conversation's next turn goes ahead of a waiting newcomer
and finds its history in the engine's cache, and a new conversation with room on neither of two
engines goes to the one that frees room first."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import words
from tests.conftest import require_binary
from tests.e2e.conftest import TINY_BLOCKS, TinyEngines
from tests.helpers import deciding, metrics_page, scrape_total

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
# The router may claim 0.15 of the engine's 16,384 KV tokens: 2,457, where one prompt of about
# 1,500 tokens fits and two do not.
SHARE = 0.15
PROMPT_WORDS = 2200  # about 1,470 of the tiny model's tokens


def _config(path: Any, grace_s: float) -> Any:
    path.write_text(
        "health:\n  scrape_timeout_s: 1.0\n"
        f"queueing:\n  kv_room: true\n  kv_room_share: {SHARE}\n  kv_room_grace_s: {grace_s}\n"
        "  kv_room_max_wait_s: 20\n"
    )
    return path


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_engines: TinyEngines) -> Iterator[LocalGateway]:
    require_binary("envoy")
    config = _config(tmp_path_factory.mktemp("room-vllm") / "router.yaml", grace_s=1.0)
    gateway = LocalGateway(
        replicas=1,
        engines=tiny_engines.fresh(),
        log_dir=tmp_path_factory.mktemp("room-vllm-gw"),
        processor_args=("--config", str(config)),
        envoy_options={"queue_wait_s": 20.0},  # as `extproc envoy-config` renders it for this config
    )
    with gateway:
        yield gateway


async def streamed(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    session: str,
    max_tokens: int = 32,
) -> dict[str, Any]:
    """A streamed chat turn: when it ended, its answer and the usage the engine reported."""
    body = {
        "model": "demo-model",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM's: the answer is as long as asked, whatever the tiny model says
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer, usage = [], {}
    async with http.post(url + CHAT, json=body, headers={"x-session-id": session}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            answer += [c["delta"].get("content") or "" for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    return {"ended": time.monotonic(), "answer": "".join(answer), "usage": usage}


async def test_a_turn_s_room_is_kept_for_its_conversation_while_a_newcomer_waits(gw: LocalGateway) -> None:
    capacity = TINY_BLOCKS * 32
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await deciding(http, gw)
        await asyncio.sleep(1.0)  # a few scrapes of the engine's /metrics: its KV size is known

        first = [{"role": "user", "content": words(random.Random(1), PROMPT_WORDS)}]

        async def conversation() -> tuple[dict[str, Any], dict[str, Any]]:
            turn = await streamed(http, gw.url, first, "s1")
            follow = [*first, {"role": "assistant", "content": turn["answer"]}, {"role": "user", "content": "and?"}]
            return turn, await streamed(http, gw.url, follow, "s1")

        async def newcomer() -> dict[str, Any]:
            await asyncio.sleep(0.05)  # while s1's first turn is being answered
            return await streamed(
                http, gw.url, [{"role": "user", "content": words(random.Random(2), PROMPT_WORDS)}], "s2"
            )

        (turn, follow_up), came = await asyncio.gather(conversation(), newcomer())

        prompt = turn["usage"]["prompt_tokens"]
        assert 1250 < prompt < capacity * SHARE - 200  # one turn fits in the room, two do not
        # The newcomer waited for s1's stream to end and for its next turn, which found its history.
        assert follow_up["ended"] < came["ended"]
        cached = (follow_up["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached >= prompt - 32
        page = await metrics_page(http, gw.metrics_url)
        assert scrape_total(page, "extproc_kv_room_wait_seconds_sum") > 0.1


@pytest.fixture(scope="module")
def gw2(tmp_path_factory: pytest.TempPathFactory, tiny_engines: TinyEngines) -> Iterator[LocalGateway]:
    """Two engines, no room kept between turns (grace 0)."""
    require_binary("envoy")
    gateway = LocalGateway(
        replicas=2,
        engines=tiny_engines.fresh(),
        log_dir=tmp_path_factory.mktemp("room-vllm-gw2"),
        processor_args=("--config", str(_config(tmp_path_factory.mktemp("room-vllm2") / "router.yaml", grace_s=0))),
        envoy_options={"queue_wait_s": 20.0},
    )
    with gateway:
        yield gateway


async def test_a_new_conversation_with_no_room_anywhere_goes_to_the_engine_that_frees_room_first(
    gw2: LocalGateway,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await deciding(http, gw2)
        await asyncio.sleep(1.0)  # a few scrapes of the engines' /metrics: their KV sizes are known

        def prompt(seed: int, length: int = PROMPT_WORDS) -> list[dict[str, str]]:
            return [{"role": "user", "content": words(random.Random(seed), length)}]

        async def newcomer() -> dict[str, Any]:
            await asyncio.sleep(0.6)  # a runs on one engine, b on the other: no room on either
            return await streamed(http, gw2.url, prompt(13), "c", max_tokens=8)

        async def short() -> dict[str, Any]:
            await asyncio.sleep(0.3)  # after a: no room beside it, so to the other engine
            return await streamed(http, gw2.url, prompt(12), "b", max_tokens=48)

        # a: a short prompt and a long answer (about 530 + 1,400 tokens, within the engines' 2,048),
        # long past b's and c's; b and c (about 1,500 each) do not fit beside it or each other.
        long = streamed(http, gw2.url, prompt(11, 800), "a", max_tokens=1400)
        long, b, c = await asyncio.gather(long, short(), newcomer())
        # c waited for b's engine and ran there while a was still being answered on the other.
        assert b["ended"] < c["ended"] < long["ended"]
        # Where the router sent each conversation, as it pinned them: c where b was, not where a was.
        async with grpc.aio.insecure_channel(gw2.admin_addresses[0]) as channel:
            stub = pb_grpc.AdminStub(channel)
            pins = {
                key: (await stub.GetSession(pb.SessionRequest(session_key=key, model="demo-model"))).replica
                for key in ("a", "b", "c")
            }
        assert pins["c"] == pins["b"] != pins["a"]
        page = await metrics_page(http, gw2.metrics_url)
        assert scrape_total(page, "extproc_kv_room_wait_seconds_count") >= 2
