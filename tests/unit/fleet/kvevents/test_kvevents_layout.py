"""The engines' reported cache layout over the configured one, and predictions that keep
disagreeing with the engine turned into a stale feed."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from extproc.adapters.admin.fleet import _feed_state
from extproc.app.router import Router
from extproc.fleet.health.vllm_metrics import parse_vllm_metrics
from extproc.fleet.kvevents.cache_state import EventCacheState
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo
from extproc.fleet.kvevents.usage import RESUME_AFTER, PredictionStreaks
from extproc.fleet.kvevents.wire import BlockStored
from extproc.request.tokenizer import PromptTokenizer
from extproc.routing.model import AffinityView
from extproc_lab.replica.engine import ReplicaEngine
from extproc_lab.replica.kv_events import TokenBlocks
from extproc_lab.replica.timing import get_profile
from extproc_lab.replica.tokenizer_dir import sample_text
from tests.helpers import Clock, chat_request, feed, kv_router

NAMES = ("r0", "r1", "r2")


def conversation(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": sample_text(160, seed)},
        {"role": "user", "content": sample_text(60, seed + 1)},
    ]


def stored(ids: tuple[int, ...], bs: int, algo: HashAlgo = HashAlgo.SHA256) -> BlockStored:
    """What vLLM publishes after prefilling ``ids`` with blocks of ``bs`` tokens."""
    n = len(ids) // bs
    return BlockStored(tuple(EngineChain(algo).hashes(ids, bs)), None, list(ids[: n * bs]), bs)


def fake_page(block_size: int, algo: HashAlgo = HashAlgo.SHA256) -> str:
    """The fake replica's /metrics page for an engine of ``block_size`` tokens per block."""
    profile = dataclasses.replace(get_profile("instant"), block_size=block_size)
    engine = ReplicaEngine(profile, token_blocks=TokenBlocks(block_size, algo))
    return engine.metrics_text("m").decode()


async def scrape(router: Router, pages: dict[str, str]) -> None:
    for name, text in pages.items():
        router.replicas.apply_scrape(name, parse_vllm_metrics(text), router.clock())
    await router.fleet.after_scrape([])


def gauge(kv: EventCacheState, name: str, *labels: str) -> float:
    value = kv.metrics.registry.get_sample_value(name, dict(zip(("replica", "cause"), labels, strict=False)))
    return -1.0 if value is None else value


# -- block size ---------------------------------------------------------------------------------


async def test_block_size_is_learned_from_events_with_a_warning_and_a_metric(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)  # kv_events.block_size left at 16
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(3)
    ids = tok.chat_ids(msgs).ids
    before = await router.route(*chat_request(msgs))
    assert before.features.tokens_per_block == 16  # nothing reported yet: the configured value
    with caplog.at_level(logging.WARNING, "extproc.fleet.kvevents"):
        for seq, name in enumerate(NAMES):
            await feed(kv, name, 0, stored(tok.chat_ids(conversation(40 + seq)).ids, 32))
        await feed(kv, "r2", 1, stored(ids, 32))
    routed = await router.route(*chat_request(msgs))
    assert routed.features.tokens_per_block == 32
    assert list(routed.features.prefix_hashes) == EngineChain(HashAlgo.SHA256).hashes(ids, 32)
    assert routed.decision.replica is not None and routed.decision.replica.name == "r2"
    assert routed.decision.matched_blocks == routed.decision.total_blocks == len(ids) // 32
    warned = [r.getMessage() for r in caplog.records if "kv_events.block_size is 16" in r.getMessage()]
    assert len(warned) == 3 and all("reports block_size 32" in w for w in warned)
    assert {n for n in NAMES if any(f"replica {n} " in w for w in warned)} == set(NAMES)
    assert [gauge(kv, "extproc_kv_events_block_size_mismatch", n) for n in NAMES] == [1.0, 1.0, 1.0]
    assert gauge(kv, "extproc_kv_events_block_size", "r0") == 32
    await feed(kv, "r0", 1, stored(ids, 32))  # more of the same: no second warning
    assert len([r for r in caplog.records if "kv_events.block_size is 16" in r.getMessage()]) == 3


async def test_block_size_and_hash_algo_are_learned_from_a_metrics_page(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, block_size=32)
    msgs = conversation(5)
    ids = PromptTokenizer(tokenizer_dir).chat_ids(msgs).ids
    with caplog.at_level(logging.WARNING, "extproc.fleet.kvevents"):
        await scrape(router, {n: fake_page(32) for n in NAMES})
    assert not caplog.records  # the configured value is what the engines report: nothing to say
    assert [gauge(kv, "extproc_kv_events_block_size_mismatch", n) for n in NAMES] == [0.0, 0.0, 0.0]
    with caplog.at_level(logging.WARNING, "extproc.fleet.kvevents"):
        await scrape(router, {n: fake_page(128, HashAlgo.SHA256_CBOR) for n in NAMES})
    routed = await router.route(*chat_request(msgs))
    assert routed.features.tokens_per_block == 128
    assert list(routed.features.prefix_hashes) == EngineChain(HashAlgo.SHA256_CBOR).hashes(ids, 128)
    text = caplog.text
    assert "replica r1 reports block_size 128 but kv_events.block_size is 32" in text
    assert "replica r1 reports prefix_caching_hash_algo sha256_cbor but kv_events.hash_algo is sha256" in text
    assert gauge(kv, "extproc_kv_events_hash_algo_mismatch", "r1") == 1.0
    assert not kv.source.suspended  # every replica fits the layout its model is hashed with


async def test_replicas_of_one_model_that_disagree_are_named_and_the_odd_one_is_not_used(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)
    tok = PromptTokenizer(tokenizer_dir)
    ids = tok.chat_ids(conversation(7)).ids
    with caplog.at_level(logging.WARNING, "extproc.fleet.kvevents"):
        await scrape(router, {"r0": fake_page(32), "r1": fake_page(32), "r2": fake_page(128)})
        for seq, name in enumerate(NAMES):
            await feed(kv, name, 0, stored(tok.chat_ids(conversation(50 + seq)).ids, 128 if name == "r2" else 32))
        routed = await router.route(*chat_request(conversation(7)))
    assert routed.features.tokens_per_block == 32  # the majority
    assert "the replicas of model 'm' report different block sizes (r0 32, r1 32, r2 128): hashing with 32" in (
        caplog.text
    )
    assert kv.source.suspended == {"r2": {"block_size"}}
    assert kv.source.live(NAMES, clock.now) == ["r0", "r1"]
    assert gauge(kv, "extproc_kv_feed_suspended", "r2", "block_size") == 1.0
    assert _feed_state(kv.source, "r2", clock.now) == "suspended (block_size)"  # as the admin API shows it
    # r2's events cannot match: the estimate answers for it, whatever they claim.
    await feed(kv, "r2", 1, stored(ids, 128))
    view = AffinityView(prefix_matches={"r2": 3})
    assert kv.view(view, routed.features, NAMES, clock.now).prefix_matches.get("r2") == 3
    # Its engine restarted with the fleet's block size: used again.
    await scrape(router, {"r2": fake_page(32)})
    await feed(kv, "r2", 0, stored(ids, 32))
    assert kv.source.suspended == {} and "r2" in kv.source.live(NAMES, clock.now)


async def test_a_tie_keeps_the_configured_block_size_and_xxhash_is_a_misfit(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, block_size=128)
    await scrape(router, {"r0": fake_page(32), "r1": fake_page(128)})
    assert kv.layouts.block_size("m") == 128
    page = fake_page(128).replace('prefix_caching_hash_algo="sha256"', 'prefix_caching_hash_algo="xxhash"')
    await scrape(router, {"r2": page})
    assert kv.layouts.misfit("r2") == "hash_algo" and kv.layouts.misfit("r0") == "block_size"
    assert kv.layouts.layout("m") == (128, HashAlgo.SHA256)  # xxhash cannot be computed: not adopted
    unknown = fake_page(128).replace('prefix_caching_hash_algo="sha256"', 'prefix_caching_hash_algo="sha512"')
    await scrape(router, {"r2": unknown})
    assert kv.layouts.misfit("r2") is None  # not known here: warned about, left to the prediction checks
    assert gauge(kv, "extproc_kv_events_hash_algo_mismatch", "r2") == 1.0


async def test_a_tie_without_the_configured_value_takes_the_smaller_block_size(tokenizer_dir: Path) -> None:
    router, kv = kv_router(tokenizer_dir, Clock(1000.0))
    await scrape(router, {"r0": fake_page(128), "r1": fake_page(32)})
    assert kv.layouts.block_size("m") == 32  # by number, not as text ("128" < "32")


# -- predictions that keep disagreeing -------------------------------------------------------------


async def route_and_check(router: Router, kv: EventCacheState, msgs: list[dict[str, str]], reported: int) -> int:
    routed = await router.route(*chat_request(msgs))
    replica = routed.decision.replica
    assert replica is not None
    predicted = kv.predicted_tokens(routed.features, replica.name, routed.decision.matched_blocks, routed.decided_at)
    assert predicted is not None
    kv.check(replica.name, predicted, reported, routed.features.tokens_per_block)
    return predicted


async def test_predictions_that_keep_disagreeing_make_the_feed_stale_until_they_agree(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, block_size=32, speculative_ttl_s=0.0, stale_after_mispredictions=3)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(9)
    ids = tok.chat_ids(msgs).ids
    for seq, name in enumerate(NAMES):
        await feed(kv, name, 0, stored(tok.chat_ids(conversation(60 + seq)).ids, 32))
    await feed(kv, "r1", 1, stored(ids, 32))  # r1's events say it holds the prompt; it reports nothing cached
    full = len(ids) // 32 * 32
    with caplog.at_level(logging.INFO, "extproc.fleet.kvevents"):
        for _ in range(2):
            assert await route_and_check(router, kv, msgs, reported=0) == full  # "over"
        assert "r1" not in kv.source.suspended
        await route_and_check(router, kv, msgs, reported=0)  # the third in a row
        assert kv.source.suspended == {"r1": {"predictions"}}
        assert not kv.source.is_live("r1", clock.now) and kv.source.speaks("r1", clock.now)
        # The estimate answers for r1 now: its events' claim is not in the view.
        routed = await router.route(*chat_request(msgs))
        assert kv.view(AffinityView(), routed.features, NAMES, clock.now).prefix_matches.get("r1") is None
        # Still checked (what its index would have predicted), never credited meanwhile.
        for _ in range(3):
            predicted = kv.predicted_tokens(routed.features, "r1", 0, clock.now)
            assert predicted == full
            kv.check("r1", predicted, 0, 32)
        assert len([r for r in caplog.records if "treated as stale" in r.getMessage()]) == 1  # logged once
        for i in range(RESUME_AFTER):
            kv.check("r1", full, full - 32, 32)  # right again (vLLM recomputes the last block)
            assert ("r1" in kv.source.suspended) == (i < RESUME_AFTER - 1)
    assert "r1's predictions agree again" in caplog.text
    assert kv.source.is_live("r1", clock.now)
    assert gauge(kv, "extproc_kv_feed_suspensions_total", "r1", "predictions") == 1.0
    assert gauge(kv, "extproc_kv_feed_suspended", "r1", "predictions") == 0.0


async def test_a_feed_that_resyncs_is_used_again(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    _, kv = kv_router(tokenizer_dir, clock, block_size=32, stale_after_mispredictions=2)
    tok = PromptTokenizer(tokenizer_dir)
    ids = tok.chat_ids(conversation(11)).ids
    await feed(kv, "r0", 0, stored(ids, 32))
    await feed(kv, "r0", 1)
    for _ in range(2):
        kv.check("r0", 320, 0, 32)
    assert not kv.source.is_live("r0", clock.now)
    await feed(kv, "r0", 0, stored(ids, 32))  # the sequence went back: a new engine, its index rebuilt
    assert kv.source.is_live("r0", clock.now)
    kv.check("r0", 320, 0, 32)  # one more wrong one is not enough: it must go wrong afresh
    assert kv.source.is_live("r0", clock.now)


def test_agreements_on_nothing_neither_break_a_wrong_streak_nor_resume() -> None:
    streaks = PredictionStreaks(3)
    assert streaks.record("a", "under", 0, 32, False) is None
    assert streaks.record("a", "agree", 0, 32, False) is None  # a cold prompt: proves nothing
    assert streaks.record("a", "under", 0, 32, False) is None
    assert streaks.record("a", "unreported", 0, 32, False) is None
    assert streaks.record("a", "under", 0, 32, False) == "suspend"
    assert [streaks.record("a", "agree", 0, 32, True) for _ in range(5)] == [None] * 5
    assert streaks.record("a", "agree", 64, 32, True) is None
    assert streaks.record("a", "agree", 64, 32, True) == "resume"
    assert PredictionStreaks(0).record("a", "over", 640, 32, False) is None  # 0: never
    # An informative agreement breaks a wrong streak.
    streaks.record("b", "over", 64, 32, False)
    streaks.record("b", "over", 64, 32, False)
    streaks.record("b", "agree", 64, 32, False)
    assert streaks.record("b", "over", 64, 32, False) is None


# -- the case, over the fake engine's real event stream ----------------------------------------


async def test_a_router_left_at_16_predicts_an_engine_of_32_exactly(tokenizer_dir: Path) -> None:
    """Issue 25: ``kv_events.block_size`` left at 16 in front of engines with 32-token blocks
    matched nothing (0 of 24 predictions right). The engine's events and page now set it."""
    import asyncio
    import tempfile

    from aiohttp import test_utils

    from extproc.fleet.kvevents.subscriber import Subscriptions
    from extproc.request.features import extract_features
    from extproc_lab.replica import build_app
    from extproc_lab.replica.kv_publisher import KvEventPublisher

    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)  # block_size: the default 16
    with tempfile.TemporaryDirectory(prefix="kvl-") as d:
        pub, replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
        publisher = KvEventPublisher(pub, replay, "kv@r0@m", "map")
        publisher.start()
        profile = dataclasses.replace(get_profile("demo", 0.01), block_size=32, num_gpu_blocks=512)
        engine = ReplicaEngine(profile, token_blocks=TokenBlocks(32), publish=publisher.publish)
        app = build_app(engine, "r0", "m", tokenizer=PromptTokenizer(tokenizer_dir), publisher=publisher)
        subs = Subscriptions(kv.source)
        subs.follow("r0", pub, replay)
        results = []
        try:
            async with test_utils.TestClient(test_utils.TestServer(app, host="127.0.0.1")) as client:
                page = await (await client.get("/metrics")).text()
                await scrape(router, {"r0": page})
                msgs = [{"role": "system", "content": sample_text(150, 3)}]
                previous = 0
                for turn in range(4):
                    msgs.append({"role": "user", "content": sample_text(40, 30 + turn)})
                    headers, body = chat_request(msgs)
                    features = await kv.tokenized(
                        extract_features(headers, body, router.config.features), json.loads(body)
                    )
                    loop = asyncio.get_running_loop()
                    end = loop.time() + 5.0
                    while turn and loop.time() < end:  # the previous turn's stores on their way
                        held = kv.source.matches("m", features.prefix_hashes, ["r0"], clock.now).get("r0", 0)
                        if held >= previous:
                            break
                        await asyncio.sleep(0.01)  # real time: events from the real ZMQ publisher
                    previous = len(features.prefix_hashes)
                    blocks = int(kv.source.matches("m", features.prefix_hashes, ["r0"], clock.now).get("r0", 0))
                    predicted = kv.predicted_tokens(features, "r0", blocks, clock.now)
                    resp = await client.post("/v1/chat/completions", json=json.loads(body) | {"max_tokens": 8})
                    answer = await resp.json()
                    reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if turn:
                        assert predicted is not None
                        results.append(kv.check("r0", predicted, reported, features.tokens_per_block))
                    msgs.append(answer["choices"][0]["message"])
                    assert features.tokens_per_block == 32
        finally:
            await subs.close()
            await publisher.close()
            await kv.close()
    assert results == ["agree"] * 3
    assert gauge(kv, "extproc_kv_events_block_size_mismatch", "r0") == 1.0
