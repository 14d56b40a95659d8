"""The fake replica publishes KV events as vLLM: token blocks keyed by vLLM's hashes, stores,
evictions and resets, and a router's index built from them agrees with its own hashing."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import test_utils

from extproc.api import (
    EventCacheState,
    KvEventMetrics,
    KvEventSettings,
    KvEventSource,
    PromptTokenizer,
    Subscriptions,
    read_request,
)
from extproc_lab.replica import ReplicaEngine, build_app, get_profile
from extproc_lab.replica.kv_events import TokenBlocks
from extproc_lab.replica.kv_publisher import KvEventPublisher
from extproc_lab.replica.tokenizer_dir import sample_text
from tests.helpers import metric_value, wait_for

MODEL = "m"


class Rig:
    def __init__(self, client: test_utils.TestClient, source: KvEventSource, publisher: KvEventPublisher, state):
        self.client, self.source, self.publisher, self.state = client, source, publisher, state

    async def chat(self, messages: list[dict[str, str]], model: str = MODEL, **extra: str) -> dict:
        resp = await self.client.post(
            "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2, **extra}
        )
        assert resp.status == 200
        return await resp.json()

    async def keys(
        self, messages: list[dict[str, str]], model: str = MODEL, session: str | None = None, **extra: str
    ) -> tuple[int, ...]:
        import json

        body = json.dumps({"model": model, "messages": messages, **extra}).encode()
        headers = {":path": "/v1/chat/completions", **({"x-session-id": session} if session else {})}
        request = read_request(headers, body, self.state_features)
        parsed = request.body.body if request.body is not None else None
        return (await self.state.tokenized(request.features, parsed)).prefix_hashes


@pytest.fixture(params=["map", "array"])
async def rig(request, tokenizer_dir: Path) -> AsyncIterator[Rig]:
    from extproc.api import FeatureSettings

    with tempfile.TemporaryDirectory(prefix="kvr-") as d:
        pub, replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
        publisher = KvEventPublisher(pub, replay, f"kv@replica-a@{MODEL}", request.param)
        publisher.start()
        profile = replace(get_profile("demo", 0.01), num_gpu_blocks=64)
        engine = ReplicaEngine(profile, token_blocks=TokenBlocks(profile.block_size), publish=publisher.publish)
        app = build_app(engine, "replica-a", MODEL, tokenizer=PromptTokenizer(tokenizer_dir), publisher=publisher)
        adapters = {"sql-lora": MODEL, "poem-lora": MODEL}
        settings = KvEventSettings(tokenizers={MODEL: str(tokenizer_dir)}, lora_adapters=adapters)
        state = EventCacheState(settings, metrics=KvEventMetrics())
        subs = Subscriptions(state.source)
        subs.follow("replica-a", pub, replay)
        async with test_utils.TestClient(test_utils.TestServer(app, host="127.0.0.1")) as client:
            r = Rig(client, state.source, publisher, state)
            r.state_features = FeatureSettings()
            await wait_for(lambda: state.source.is_live("replica-a", 0.0))
            yield r
        await subs.close()
        await publisher.close()
        await state.close()


def convo(seed: int, turns: int = 1) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": sample_text(60, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": sample_text(30, seed * 10 + t)})
    return msgs


async def test_stores_match_the_routers_hashes_and_cached_tokens(rig: Rig) -> None:
    msgs = convo(1)
    keys = await rig.keys(msgs)
    first = await rig.chat(msgs)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await wait_for(lambda: rig.source.matches(MODEL, keys, ["replica-a"], 0.0).get("replica-a") == len(keys))
    again = await rig.chat(msgs)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(keys) * 16


async def test_evictions_and_reset_are_published(rig: Rig) -> None:
    msgs = convo(2)
    keys = await rig.keys(msgs)
    await rig.chat(msgs)
    await wait_for(lambda: rig.source.matches(MODEL, keys, ["replica-a"], 0.0).get("replica-a") == len(keys))
    for seed in range(10, 30):  # 64 blocks: other prompts evict it
        await rig.chat(convo(seed))
    await wait_for(lambda: rig.source.matches(MODEL, keys, ["replica-a"], 0.0).get("replica-a", 0) < len(keys))
    assert rig.source.index.model(MODEL).blocks("replica-a") <= 64
    await rig.client.post("/reset_prefix_cache")
    await wait_for(lambda: rig.source.index.model(MODEL).blocks("replica-a") == 0)


async def test_a_dropped_batch_is_replayed(rig: Rig) -> None:
    await rig.client.post("/kv_events/drop?n=1")
    msgs = convo(3)
    keys = await rig.keys(msgs)
    await rig.chat(msgs)  # its stores are lost on the way...
    await rig.chat(convo(4))  # ...and the next batch shows the gap
    await wait_for(lambda: rig.source.matches(MODEL, keys, ["replica-a"], 0.0).get("replica-a") == len(keys))
    assert metric_value(rig.source.metrics.replays.labels("replica-a", "ok")) >= 2  # catch-up, then the gap


def vllm_chain_by_hand(ids: tuple[int, ...], extra: tuple[str, ...] | None, salt: str | None = None) -> list[int]:
    """vLLM's sha256 chain written out from its definition, sharing no code with the router:
    ``sha256(pickle((parent, tokens, extra_keys)))``, the root ``sha256(pickle("vllm-none-hash"))``,
    the int form the digest's last 8 bytes."""
    import hashlib
    import pickle

    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = h("vllm-none-hash"), []
    for start in range(0, len(ids) - len(ids) % 16, 16):
        keys = (*(extra or ()), salt) if salt and start == 0 else extra  # the salt: first block only
        parent = h((parent, tuple(ids[start : start + 16]), keys))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


async def test_lora_adapters_hash_apart_as_vllm_does(rig: Rig, tokenizer_dir: Path) -> None:
    msgs = convo(5)
    base, sql, poem = [await rig.keys(msgs, m) for m in (MODEL, "sql-lora", "poem-lora")]
    assert len(base) == len(sql) == len(poem) > 2
    assert not {*base} & {*sql} and not {*sql} & {*poem} and not {*base} & {*poem}
    ids = PromptTokenizer(tokenizer_dir).chat_ids(msgs).ids
    assert list(sql) == vllm_chain_by_hand(ids, ("sql-lora",))
    assert list(base) == vllm_chain_by_hand(ids, None)

    first = await rig.chat(msgs, "sql-lora")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    await wait_for(lambda: rig.source.matches(MODEL, sql, ["replica-a"], 0.0).get("replica-a") == len(sql))
    # The adapter's blocks are indexed under the base model's topic, and match only the adapter.
    assert rig.source.matches(MODEL, poem, ["replica-a"], 0.0) == {}
    assert rig.source.matches(MODEL, base, ["replica-a"], 0.0) == {}
    # The replica agrees: the other adapter and the base model find nothing cached.
    other = await rig.chat(msgs, "poem-lora")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = await rig.chat(msgs)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = await rig.chat(msgs, "sql-lora")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(sql) * 16


def test_stored_events_name_the_adapter() -> None:
    from extproc.api import BlockStored
    from extproc_lab.replica.kv_events import KvEventRecorder

    blocks = TokenBlocks(4)
    keys = blocks.keys(list(range(8)), 8, "sql-lora")
    recorder = KvEventRecorder(blocks)
    for k in keys:
        recorder.stored(k)
    (event,) = recorder.drain()
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, event.lora_name, event.parent) == (keys, "sql-lora", None)


async def test_a_cache_salt_changes_the_chain_from_its_first_block_as_vllm_does(rig: Rig, tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    first, second = convo(7, turns=1), convo(7, turns=3)
    for turn in (first, second):  # one session, two turns: the memo reuses the salted chain
        ids = tok.chat_ids(turn).ids
        salted = await rig.keys(turn, session="s", cache_salt="tenant-a")
        assert list(salted) == vllm_chain_by_hand(ids, None, "tenant-a")
        both = await rig.keys(turn, "sql-lora", session="s", cache_salt="tenant-a")
        assert list(both) == vllm_chain_by_hand(ids, ("sql-lora",), "tenant-a")
        assert list(await rig.keys(turn, session="s")) == vllm_chain_by_hand(ids, None)
    salted = await rig.keys(second, cache_salt="tenant-a")
    await rig.chat(second, cache_salt="tenant-a")
    await wait_for(lambda: rig.source.matches(MODEL, salted, ["replica-a"], 0.0).get("replica-a") == len(salted))
    assert (await rig.chat(second))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await rig.chat(second, cache_salt="tenant-b"))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = await rig.chat(second, cache_salt="tenant-a")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(salted) * 16
