"""Tenants, request classes and LoRA adapters: resolution, pools, shards, quotas, adapters."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from extproc.app.router import Router
from extproc.config import ConfigError, config_from_mapping, parse_replica
from extproc.fleet.health.vllm_metrics import LoraInfo, ReplicaMetrics
from extproc.request import FeatureSettings, extract_features
from extproc.request.tenant import api_key_digest
from extproc.routing import Reason
from extproc.routing.registry import SCORES_PROFILE
from tests.conftest import body_message, chat_body, headers_message
from tests.helpers import SEED_CLASSES, metric_value, run

CHAT = {":path": "/v1/chat/completions"}
POOLS = ["short", "short", "long", "long", "multimodal", "batch", "overflow"]


def fleet_config(**extra: object) -> dict[str, object]:
    replicas = [
        {"name": f"r{i}", "address": f"10.0.0.{i}:8000", "labels": {"pool": pool}} for i, pool in enumerate(POOLS)
    ]
    extra = {**extra, "tenants": {"trust_header": True, **extra.get("tenants", {})}}  # type: ignore[dict-item]
    return {"replicas": replicas, "classes": SEED_CLASSES, "metrics": {"enabled": False}, **extra}


def media_body() -> bytes:
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def test_api_key_maps_to_its_tenant_and_beats_the_header() -> None:
    settings = FeatureSettings(api_keys={api_key_digest("sk-team-a"): "team-a"}, tenant_header="x-tenant-id")
    headers = {**CHAT, "authorization": "Bearer sk-team-a", "x-tenant-id": "someone-else"}
    assert extract_features(headers, chat_body("x"), settings).tenant == "team-a"
    unknown = {**CHAT, "authorization": "Bearer sk-unknown", "x-tenant-id": "claimed"}
    assert extract_features(unknown, chat_body("x"), settings).tenant == "claimed"


def test_a_client_s_tenant_header_is_ignored_unless_the_gateway_sets_it() -> None:
    # Not trusted (the default): a client naming a tenant is nobody's; a mapped key still counts.
    keys = {"tenants": {"api_keys": {api_key_digest("sk-team-a"): "team-a"}}}
    settings = config_from_mapping(keys).features
    assert extract_features({**CHAT, "x-tenant-id": "acme"}, chat_body("x"), settings).tenant == ""
    keyed = {**CHAT, "authorization": "Bearer sk-team-a", "x-tenant-id": "acme"}
    assert extract_features(keyed, chat_body("x"), settings).tenant == "team-a"
    # Trusted (the gateway's authentication sets it, after Envoy stripped the client's): read.
    trusted = config_from_mapping({"tenants": {"header": "X-Org", "trust_header": True}}).features
    assert extract_features({**CHAT, "x-org": "acme"}, chat_body("x"), trusted).tenant == "acme"
    assert extract_features({**CHAT, "x-tenant-id": "acme"}, chat_body("x"), trusted).tenant == ""


def test_api_keys_must_be_digests_never_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SHA-256"):
        config_from_mapping({"tenants": {"api_keys": {"sk-plain-key": "team-a"}}})
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{api_key_digest('sk-b')}: team-b\n")
    cfg = config_from_mapping({"tenants": {"api_keys_file": str(keys)}})
    assert cfg.features.api_keys == {api_key_digest("sk-b"): "team-b"}


@pytest.mark.parametrize(
    ("headers", "body", "cls"),
    [
        ({"x-request-class": "batch"}, chat_body("x" * 100), "batch"),
        ({}, media_body(), "multimodal"),
        ({}, chat_body("y" * 12_000, stream=True), "long-context"),
        ({}, chat_body("short question"), "short"),
        ({}, chat_body("z" * 5_000), "default"),  # long but not streaming: no rule, the whole fleet
    ],
)
async def test_the_seed_classes_go_to_their_pools(headers: dict[str, str], body: bytes, cls: str) -> None:
    router = Router(config_from_mapping(fleet_config()))
    routed = await router.route({**CHAT, **headers}, body)
    assert routed.features.request_class == cls
    assert routed.decision.replica is not None
    pool = routed.decision.replica.labels["pool"]
    if cls == "default":
        return
    assert pool == {"batch": "batch", "multimodal": "multimodal", "long-context": "long", "short": "short"}[cls]


async def test_an_empty_pool_falls_back_to_the_fleet() -> None:
    # One router, two classes: a pool that exists confines its requests, one that matches no
    # replica lets them use the whole fleet rather than fail.
    classes = [
        {"name": "gpu-x", "match": {"headers": {"x-request-class": "x"}}, "pool": {"pool": "nonexistent"}},
        {"name": "batch", "match": {"headers": {"x-request-class": "batch"}}, "pool": {"pool": "batch"}},
    ]
    router = Router(config_from_mapping(fleet_config(classes=classes)))
    used: dict[str, set[str]] = {"x": set(), "batch": set()}
    for i in range(60):
        for cls, replicas in used.items():
            headers = {**CHAT, "x-request-class": cls, "x-session-id": f"{cls}{i}"}
            routed = await router.route(headers, chat_body(f"{i}"))
            assert routed.decision.replica is not None
            replicas.add(routed.decision.replica.name)
            router.release(routed)
    assert used["batch"] == {"r5"}
    assert len(used["x"]) > len(POOLS) // 2  # the fleet, spread by load (r5 is busy with batch)


async def test_a_tenant_is_confined_to_its_shard() -> None:
    cfg = fleet_config(classes=[], tenants={"definitions": {"t": {"shard_size": 2}}})
    router = Router(config_from_mapping(cfg))
    used = Counter()
    for i in range(60):
        routed = await router.route({**CHAT, "x-tenant-id": "t", "x-session-id": f"s{i}"}, chat_body(f"c{i}"))
        assert routed.decision.replica is not None
        used[routed.decision.replica.name] += 1
        router.release(routed)
    assert len(used) == 2


async def test_over_quota_is_refused_with_429_and_retry_after_while_others_go_on() -> None:
    cfg = fleet_config(classes=[], tenants={"definitions": {"noisy": {"max_concurrent": 2, "retry_after_s": 3}}})
    router = Router(config_from_mapping(cfg))
    held = [await router.route({**CHAT, "x-tenant-id": "noisy"}, chat_body(f"n{i}")) for i in range(2)]
    out = await run(router, [headers_message({**CHAT, "x-tenant-id": "noisy"}), body_message(chat_body("n3"))])
    rejected = out[1].immediate_response
    assert rejected.status.code == 429
    assert {h.header.key: h.header.raw_value for h in rejected.headers.set_headers}["retry-after"] == b"3"
    steady = await router.route({**CHAT, "x-tenant-id": "steady"}, chat_body("s"))
    assert steady.decision.replica is not None  # another tenant is unaffected
    router.release(held[0])
    again = await router.route({**CHAT, "x-tenant-id": "noisy"}, chat_body("n4"))
    assert again.decision.replica is not None  # a slot came free
    assert metric_value(router.metrics.decisions.labels(Reason.QUOTA.value, "m")) == 1


async def test_over_quota_can_overflow_to_a_shared_pool() -> None:
    cfg = fleet_config(classes=[], tenants={"definitions": {"noisy": {"max_concurrent": 1, "over_quota": "overflow"}}})
    router = Router(config_from_mapping(cfg))
    first = await router.route({**CHAT, "x-tenant-id": "noisy"}, chat_body("a"))
    second = await router.route({**CHAT, "x-tenant-id": "noisy"}, chat_body("b"))
    assert first.decision.replica is not None and second.decision.replica is not None
    assert second.decision.replica.labels["pool"] == "overflow"


async def test_tenant_headroom_spreads_one_tenants_burst() -> None:
    # In the scores profile headroom outweighs a short prompt's prefix; under the price it only
    # breaks ties (3 ms at full), and a burst leaves its prefix's replica when its queue costs more.
    cfg = fleet_config(
        classes=[],
        tenants={"definitions": {"t": {"max_concurrent": 100}}, "per_replica": 2},
        profile=SCORES_PROFILE,
    )
    router = Router(config_from_mapping(cfg))
    held = [await router.route({**CHAT, "x-tenant-id": "t"}, chat_body("same prompt " * 50)) for _ in range(8)]
    assert len({r.decision.replica.name for r in held if r.decision.replica}) >= 3


async def test_lora_adapter_prefers_a_replica_that_has_it_and_respects_max_lora() -> None:
    router = Router(config_from_mapping(fleet_config(classes=[])))
    base = dict(running=1, waiting=0, kv_usage=0.1, models=("base",))
    for i in range(len(POOLS)):
        running = ("sql-lora",) if i == 3 else ("a", "b") if i < 3 else ()
        lora = LoraInfo(max_lora=2, running=running, waiting=())
        router.replicas.apply_scrape(f"r{i}", ReplicaMetrics(lora=lora, **base), now=router.clock())  # type: ignore[arg-type]
    body = json.dumps({"model": "sql-lora", "prompt": "select"}).encode()
    chosen = Counter()
    for i in range(20):
        routed = await router.route({":path": "/v1/completions", "x-session-id": f"q{i}"}, body + b" " * i)
        assert routed.decision.replica is not None
        chosen[routed.decision.replica.name] += 1
        router.release(routed)
    assert chosen.most_common(1)[0][0] == "r3"
    assert not {"r0", "r1", "r2"} & set(chosen)  # their adapter slots are full


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"classes": [{"name": "x", "match": {"colour": "red"}}]}, "classes[0].match"),
        ({"classes": [{"name": "x", "profile": "nope"}]}, "classes[0].profile"),
        ({"tenants": {"definitions": {"t": {"over_quota": "explode"}}}}, "tenants.definitions.t.over_quota"),
        ({"tenants": {"definitions": {"t": {"max_share": 3}}}}, "tenants.definitions.t.max_share"),
        ({"profiles": {"p": {"scorers": [{"type": "nope"}]}}}, "profiles.p"),
    ],
)
def test_tenant_and_class_config_errors_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_from_mapping(raw)


def test_replica_flag_carries_labels() -> None:
    replica = parse_replica("r0=127.0.0.1:8000,pool=short,tier=a")
    assert replica.labels == {"pool": "short", "tier": "a"}
    with pytest.raises(ConfigError):
        parse_replica("r0=127.0.0.1:8000,nolabel")
