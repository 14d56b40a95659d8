"""Each of a request's hashes is computed once, in the key space its lookups use: character
blocks once the served model is known (a split's arm) and only where no tokenizer keys the blocks,
the prefix key's fingerprint once where hot keys are on."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.app.router import Router
from extproc.observe.hotkeys import detector
from extproc.observe.hotkeys.detector import HotKeySettings
from extproc.request import features as features_module
from extproc.request.splits import SplitRule, SplitTarget
from extproc.routing import pipeline
from tests.conftest import chat_body, make_config
from tests.helpers import BS, Clock, chat_request, conversation, kv_router

CHAT = {":path": "/v1/chat/completions", "x-session-id": "s"}
PROMPT = "a prompt long enough to fill a few blocks of sixty-four characters " * 8


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Replace ``module.name`` by a wrapper counting its calls (the list's length)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


async def test_a_split_request_hashes_its_blocks_once_with_the_served_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch, features_module, "block_hashes")
    router = Router(make_config(splits=(SplitRule("c", (SplitTarget("m-v2", 1),), model="m"),)))
    routed = await router.route(CHAT, chat_body(PROMPT))
    assert routed.arm is not None and routed.features.model == "m-v2" and routed.features.prefix_hashes
    assert len(calls) == 1
    # The same hashes as a request naming the served model in its own body.
    direct = features_module.read_request(CHAT, routed.answer.body, router.config.features).features
    assert routed.features.prefix_hashes == direct.prefix_hashes


async def test_tokenized_requests_hash_no_character_blocks(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router, _ = kv_router(tokenizer_dir, Clock(1000.0))
    calls = count_calls(monkeypatch, features_module, "block_hashes")
    routed = await router.route(*chat_request(conversation(2), session="s"))
    assert routed.features.tokens_per_block == BS and routed.features.prefix_hashes
    assert calls == []
    # A model without a tokenizer still gets its character blocks, once.
    other = await router.route(CHAT, chat_body(PROMPT, model="other"))
    assert other.features.tokens_per_block == 0 and other.features.prefix_hashes and len(calls) == 1


async def test_the_prefix_fingerprint_is_computed_once_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    import extproc.core.request as router_module

    settings = HotKeySettings(
        enabled=True, sample_rate=1.0, window_s=1.0, min_samples=4, replica_prefill_tokens_per_s=5_000
    )
    clock = Clock(0.0)
    router = Router(make_config(hot_keys=settings), clock=clock)
    calls = count_calls(monkeypatch, router_module, "fingerprint")
    in_decision = count_calls(monkeypatch, pipeline, "fingerprint")
    in_detector = count_calls(monkeypatch, detector, "fingerprint")
    hot_prompt = "You are the support agent of a large shop. " * 80  # past block 32
    others = [f"Prompt {g}: " + f"another assistant number {g}. " * 100 for g in range(20)]
    n = 600
    for i in range(n):  # 200 a second, a third of them one prefix: found hot, the hot path runs too
        clock.now = i / 200
        prompt = hot_prompt if i % 3 == 0 else others[i % 20]
        routed = await router.route({":path": "/v1/chat/completions"}, chat_body(prompt))
        assert routed.decision.replica is not None
    assert router.hot_keys is not None and router.hot_keys.table()
    assert len(calls) == n and in_decision == in_detector == []  # the decision and the detector were given it
