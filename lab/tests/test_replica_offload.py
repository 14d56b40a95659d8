"""CPU memory behind the fake replica's cache, as vLLM's offloading connector: every block cached
is copied there, its events carry ``medium: "CPU"``, and a prefix the GPU evicted is loaded back
from it and reported among the request's cached tokens."""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import test_utils

from extproc.api import (
    BlockRemoved,
    BlockStored,
    EventCacheState,
    FeatureSettings,
    KvEventMetrics,
    KvEventSettings,
    PromptTokenizer,
    Subscriptions,
    read_request,
)
from extproc_lab.replica import ReplicaEngine, build_app, get_profile
from extproc_lab.replica.kv_events import TokenBlocks
from extproc_lab.replica.kv_publisher import KvEventPublisher
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.replica.offload import CpuTier
from extproc_lab.replica.tokenizer_dir import sample_text
from tests.helpers import wait_for

MODEL = "m"
REPLICA = "replica-a"


def test_the_cpu_tier_keeps_the_most_recent_blocks() -> None:
    tier = CpuTier(3)
    for key in (1, 2, 3):
        tier.store(key, 1)
    tier.store(1, 1)  # stored again: the most recent
    tier.store(4, 1)
    assert 2 not in tier and all(k in tier for k in (1, 3, 4)) and len(tier) == 3
    assert tier.run([1, 9, 3], 0) == 1 and tier.run([9, 3, 4], 1) == 2


def test_a_prefix_the_gpu_evicted_is_loaded_from_cpu_memory_and_counted_cached() -> None:
    profile = replace(get_profile("demo", 0.01), num_gpu_blocks=12, block_size=16, cpu_offload_blocks=64)
    model = ReplicaModel(profile)
    assert model.pool.offload is not None

    def run(seq: Seq) -> None:
        model.submit(seq, 0.0)
        while not model.idle:
            model.begin_step(0.0)
            model.end_step()

    first = Seq("a", 70, 1, keys=(1, 2, 3, 4))
    run(first)
    run(Seq("b", 176, 1, keys=tuple(range(10, 21))))  # fills the GPU: a's blocks go
    on_gpu = model.pool.match((1, 2, 3, 4))
    assert on_gpu < 4 and model.pool.offload.run((1, 2, 3, 4), 0) == 4
    hits = model.prefix_hits_tokens
    again = Seq("c", 70, 1, keys=(1, 2, 3, 4))
    run(again)
    assert again.cached_tokens == 64  # loaded, not computed
    # The GPU pool's own hit counter counts what it held itself, as vllm:prefix_cache_hits_total.
    assert model.prefix_hits_tokens == hits + 16 * on_gpu


@pytest.fixture
async def rig(tokenizer_dir: Path) -> AsyncIterator[tuple[test_utils.TestClient, EventCacheState, list]]:
    with tempfile.TemporaryDirectory(prefix="kvo-") as d:
        pub, replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
        publisher = KvEventPublisher(pub, replay, f"kv@{REPLICA}@{MODEL}", "map")
        publisher.start()
        sent: list = []
        profile = replace(get_profile("demo", 0.01), num_gpu_blocks=64, cpu_offload_blocks=1024)

        def publish(events: list) -> None:
            sent.extend(events)
            publisher.publish(events)

        engine = ReplicaEngine(profile, token_blocks=TokenBlocks(profile.block_size), publish=publish)
        app = build_app(engine, REPLICA, MODEL, tokenizer=PromptTokenizer(tokenizer_dir), publisher=publisher)
        state = EventCacheState(KvEventSettings(tokenizers={MODEL: str(tokenizer_dir)}), metrics=KvEventMetrics())
        subs = Subscriptions(state.source)
        subs.follow(REPLICA, pub, replay)
        async with test_utils.TestClient(test_utils.TestServer(app, host="127.0.0.1")) as client:
            await wait_for(lambda: state.source.is_live(REPLICA, 0.0))
            yield client, state, sent
        await subs.close()
        await publisher.close()
        await state.close()


def convo(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": sample_text(60, seed)},
        {"role": "user", "content": sample_text(30, seed * 10)},
    ]


async def test_tiered_events_keep_an_evicted_prefix_held_and_its_next_turn_hits(rig) -> None:  # type: ignore[no-untyped-def]
    client, state, sent = rig

    async def chat(msgs: list[dict[str, str]]) -> int:
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2})
        assert resp.status == 200
        return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    msgs = convo(1)
    body = json.dumps({"model": MODEL, "messages": msgs}).encode()
    request = read_request({":path": "/v1/chat/completions"}, body, FeatureSettings())
    keys = (await state.tokenized(request.features, request.body.body if request.body else None)).prefix_hashes
    n = len(keys)

    def held() -> tuple[int, float]:
        return state.source.holdings(MODEL, keys, [REPLICA], 0.0).get(REPLICA, (0, 0.0))

    assert await chat(msgs) == 0
    await wait_for(lambda: held() == (n, float(n)))
    # Stored on both tiers, with the same hashes, parents and tokens.
    gpu = [e for e in sent if isinstance(e, BlockStored) and e.medium == "GPU"]
    cpu = [e for e in sent if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [h for e in cpu for h in e.block_hashes][:n] == [h for e in gpu for h in e.block_hashes][:n] == list(keys)
    for seed in range(10, 30):  # 64 GPU blocks: other prompts evict it from the GPU, not from CPU memory
        await chat(convo(seed))
    await wait_for(lambda: held()[0] == n and held()[1] < n)
    assert any(isinstance(e, BlockRemoved) and e.medium == "GPU" and keys[0] in e.block_hashes for e in sent)
    assert not any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in sent)
    # Its next turn is loaded from CPU memory: cached whole, and back on the GPU.
    assert await chat(msgs) == n * 16
    await wait_for(lambda: held() == (n, float(n)))
