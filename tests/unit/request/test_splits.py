"""Split rules: matching, the arm hashed on a stable key, pins, and the body rewrite."""

from __future__ import annotations

import json

import pytest

from extproc.config import config_from_mapping
from extproc.request.splits import SplitRule, SplitTarget, choose_arm, rewrite_model

RULE = SplitRule(
    "canary",
    (SplitTarget("m-v1", 90), SplitTarget("m-v2", 10, pool="canary")),
    model="m*",
    headers={"x-team": "a"},
    cookies={"beta": "1"},
    query={"ab": "on"},
)


def test_every_condition_must_hold() -> None:
    ok = {"x-team": "a", "cookie": "beta=1; other=2", ":path": "/v1/chat/completions?ab=on"}
    assert RULE.matches("model", ok)
    assert not RULE.matches("other", ok)
    assert not RULE.matches("model", {**ok, "x-team": "b"})
    assert not RULE.matches("model", {**ok, "cookie": "beta=0"})
    assert not RULE.matches("model", {**ok, "cookie": "\x00 broken;;="})
    assert not RULE.matches("model", {**ok, ":path": "/v1/chat/completions"})


def test_the_arm_is_stable_per_key_and_weighted() -> None:
    rule = SplitRule("r", (SplitTarget("a", 90), SplitTarget("b", 10)))
    arms = [choose_arm((rule,), "x", {}, f"session-{i}") for i in range(20_000)]
    assert all(a is not None for a in arms)
    share = sum(a.target.model == "b" for a in arms if a) / len(arms)
    assert abs(share - 0.10) < 0.01
    assert all(choose_arm((rule,), "x", {}, f"session-{i}") == arms[i] for i in range(100))


def test_a_pin_header_naming_a_target_overrides_the_hash_and_others_are_ignored() -> None:
    rule = SplitRule("r", (SplitTarget("a", 100), SplitTarget("b", 0)))
    pinned = choose_arm((rule,), "x", {"x-canary": "b"}, "k")
    assert pinned is not None and pinned.target.model == "b" and pinned.pinned
    unknown = choose_arm((rule,), "x", {"x-canary": "nope"}, "k")
    assert unknown is not None and unknown.target.model == "a" and not unknown.pinned


def test_first_match_wins_and_no_match_is_none() -> None:
    first = SplitRule("first", (SplitTarget("one", 1),), model="a*")
    second = SplitRule("second", (SplitTarget("two", 1),))
    arm = choose_arm((first, second), "abc", {}, "k")
    assert arm is not None and arm.rule == "first"
    arm = choose_arm((first, second), "zzz", {}, "k")
    assert arm is not None and arm.rule == "second"
    assert choose_arm((first,), "zzz", {}, "k") is None


def test_rewrite_keeps_everything_but_the_model() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo"}], "stream": True}
    out = rewrite_model(body, "m-v2")
    assert json.loads(out) == {**body, "model": "m-v2"}
    assert "héllo" in out.decode()  # not escaped: the replica reads the same text
    assert body["model"] == "m"  # the parsed body others read is left alone


def test_the_config_builds_rules() -> None:
    cfg = config_from_mapping(
        {
            "splits": [
                {
                    "name": "c",
                    "match": {"model": "m*", "headers": {"X-Team": "a"}},
                    "targets": [{"model": "v1", "weight": 9}, {"model": "v2", "weight": 1, "pool": "canary"}],
                    "pin_header": "X-Arm",
                }
            ]
        }
    )
    (rule,) = cfg.splits
    assert rule.headers == {"x-team": "a"} and rule.pin_header == "x-arm" and rule.targets[1].pool == "canary"


async def test_the_router_rewrites_the_body_and_hashes_the_served_model() -> None:
    from extproc.app.router import Router
    from extproc.request.features import extract_features
    from tests.conftest import chat_body, make_config

    rule = SplitRule("c", (SplitTarget("m-v2", 1, pool="canary"),), model="m")
    router = Router(make_config(splits=(rule,)))
    body = chat_body("a prompt long enough to fill a few blocks of sixty-four characters " * 4)
    routed = await router.route({":path": "/v1/chat/completions", "x-session-id": "s"}, body)
    assert routed.arm is not None and routed.arm.target.model == "m-v2"
    assert routed.answer.body is not None and json.loads(routed.answer.body)["model"] == "m-v2"
    served = extract_features({":path": "/v1/chat/completions"}, routed.answer.body, router.config.features)
    assert routed.features.model == "m-v2" and routed.features.prefix_hashes == served.prefix_hashes
    original = extract_features({":path": "/v1/chat/completions"}, body, router.config.features)
    assert routed.features.prefix_hashes != original.prefix_hashes
    assert routed.features.pool == (("pool", "canary"),)
    untouched = await router.route({":path": "/v1/chat/completions"}, chat_body("x", model="other"))
    assert untouched.arm is None and untouched.answer.body is None


async def test_a_split_request_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.app.router import Router
    from extproc.request import openai_body
    from tests.conftest import chat_body, make_config

    calls = 0
    loads = openai_body.orjson.loads

    def counted(raw: bytes | str) -> object:
        nonlocal calls
        calls += 1
        return loads(raw)

    monkeypatch.setattr(openai_body.orjson, "loads", counted)
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed again with json"))
    rule = SplitRule("c", (SplitTarget("m-v2", 1),), model="m")
    router = Router(make_config(splits=(rule,)))
    routed = await router.route({":path": "/v1/chat/completions", "user": "u"}, chat_body("a prompt " * 40))
    assert routed.arm is not None and routed.answer.body is not None
    assert calls == 1
