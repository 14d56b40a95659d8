"""Routing on KV events: tokenizing as vLLM does, the event index feeding the decision, the
fallback to the estimate, speculative credit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.fleet.kvevents.cache_state import EventCacheState
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo, content_chain
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.kvevents.wire import AllBlocksCleared, BlockRemoved
from extproc.observe.metrics.kv_events import KvEventMetrics
from extproc.request.tokenizer import PromptTokenizer, TokenizerError
from extproc.routing.model import AffinityView
from extproc_lab.replica.tokenizer_dir import sample_text
from tests.conftest import make_config
from tests.helpers import BS, Clock, chat_request, conversation, feed, kv_router, metric_value, stored_event

# -- tokenizing --------------------------------------------------------------------------------


def test_chat_is_the_rendered_template_without_extra_special_tokens(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    msgs = [{"role": "user", "content": "hello there"}]
    text = tok.render_chat(msgs)
    assert text == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_ids(msgs).ids == tuple(tok.tokenizer.encode(text, add_special_tokens=False).ids)
    completion = tok.completion_ids("hello there")
    assert completion.ids[0] == tok.tokenizer.token_to_id("<|endoftext|>")  # with special tokens
    assert tok.completion_ids([5, 6, 7]).ids == (5, 6, 7)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_turns_equal_full_tokenization(tokenizer_dir: Path, seed: int) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    reused = 0
    for turns in range(1, 6):
        msgs = conversation(turns, seed)
        got = tok.chat_ids(msgs, session="s")
        full = tok.tokenizer.encode(tok.render_chat(msgs), add_special_tokens=False).ids
        assert got.ids == tuple(full)
        reused += got.reused
    assert reused > 0  # later turns reused earlier ones
    # A session whose history changed is tokenized from scratch, still right.
    changed = conversation(3, seed + 50)
    assert tok.chat_ids(changed, session="s").ids == tuple(
        tok.tokenizer.encode(tok.render_chat(changed), add_special_tokens=False).ids
    )


@pytest.mark.parametrize("seed", range(4))
def test_prompts_sharing_a_head_reuse_it_and_equal_full_tokenization(tokenizer_dir: Path, seed: int) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    system = conversation(1, seed)[0]

    def full(msgs: list[dict[str, str]]) -> tuple[int, ...]:
        return tuple(tok.tokenizer.encode(tok.render_chat(msgs), add_special_tokens=False).ids)

    # No session: distinct questions after one system prompt; the second on reuse its tokens.
    for q in range(4):
        msgs = [system, {"role": "user", "content": sample_text(30, seed * 10 + q)}]
        got = tok.chat_ids(msgs)
        assert got.ids == full(msgs)
        assert (got.reused > 0) == (q > 0)
    # Another session's first turn, and a session whose history was rewritten mid-way: the shared
    # part reused, the rest encoded, the same ids as tokenizing it whole.
    first = [system, {"role": "user", "content": sample_text(30, seed + 99)}]
    got = tok.chat_ids(first, session="fresh")
    assert got.ids == full(first) and got.reused > 0
    msgs = conversation(4, seed)
    tok.chat_ids(msgs, session="s")
    rewritten = [*msgs[:3], {"role": "assistant", "content": "edited"}, *msgs[4:]]
    got = tok.chat_ids(rewritten, session="s")
    assert got.ids == full(rewritten) and got.reused > 0
    # A prompt unlike anything seen: nothing reused, still right.
    other = conversation(2, seed + 500)
    assert tok.chat_ids(other).ids == full(other)


def test_the_head_store_stays_within_its_characters(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir, head_store_chars=5_000)
    for seed in range(20):
        msgs = conversation(1, seed)
        assert tok.chat_ids(msgs).ids == tuple(
            tok.tokenizer.encode(tok.render_chat(msgs), add_special_tokens=False).ids
        )
    assert 0 < tok._head_chars <= 5_000
    assert sum(len(t.text) for t in (tok._heads or {}).values()) == tok._head_chars


def test_bad_tokenizer_directory_and_media_are_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(TokenizerError):
        PromptTokenizer(tmp_path)
    tok = PromptTokenizer(tokenizer_dir)
    with pytest.raises(TokenizerError):
        tok.chat_ids([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# -- routing -----------------------------------------------------------------------------------


async def test_little_left_to_encode_is_tokenized_on_the_loop_the_rest_in_a_worker(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)
    submitted: list[object] = []
    pool = kv._executor

    class Counting:
        def submit(self, fn: Any, *args: Any) -> Any:
            submitted.append(fn)
            return pool.submit(fn, *args)

    kv._executor = Counting()  # type: ignore[assignment]
    tok = PromptTokenizer(tokenizer_dir)
    system = {"role": "system", "content": sample_text(400, 3)}  # far more than INLINE_CHARS

    async def hashes(msgs: list[dict[str, str]], session: str | None = None) -> list[int]:
        routed = await router.route(*chat_request(msgs, session))
        assert list(routed.features.prefix_hashes) == EngineChain(HashAlgo.SHA256).hashes(tok.chat_ids(msgs).ids, BS)
        return list(routed.features.prefix_hashes)

    first = [system, {"role": "user", "content": sample_text(20, 1)}]
    await hashes(first)
    assert len(submitted) == 1  # a long prompt seen nowhere: the worker
    second = [system, {"role": "user", "content": sample_text(20, 2)}]
    assert (await hashes(second))[:3] == (await hashes(first))[:3]
    assert len(submitted) == 1  # the same system prompt, a short question: on the loop
    await hashes([{"role": "system", "content": sample_text(400, 4)}, {"role": "user", "content": "hi"}])
    assert len(submitted) == 2  # another long system prompt: the worker again


async def test_tokenized_features_carry_vllm_block_hashes(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, _ = kv_router(tokenizer_dir, clock)
    msgs = conversation(2)
    routed = await router.route(*chat_request(msgs))
    tok = PromptTokenizer(tokenizer_dir)
    ids = tok.chat_ids(msgs).ids
    assert routed.features.prompt_tokens == len(ids)
    assert routed.features.tokens_per_block == BS
    assert list(routed.features.prefix_hashes) == EngineChain(HashAlgo.SHA256).hashes(ids, BS)


@pytest.mark.parametrize("algo", [HashAlgo.SHA256, HashAlgo.SHA256_CBOR, HashAlgo.CONTENT])
async def test_a_prompt_goes_where_events_say_its_blocks_are(tokenizer_dir: Path, algo: HashAlgo) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, hash_algo=algo)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(3, seed=7)
    for i, name in enumerate(("r0", "r1", "r2")):
        await feed(kv, name, 0, stored_event(tok, conversation(1, seed=30 + i), algo))  # unrelated blocks
    await feed(kv, "r2", 1, stored_event(tok, msgs, algo))
    routed = await router.route(*chat_request(msgs))
    assert routed.decision.replica is not None and routed.decision.replica.name == "r2"
    assert routed.decision.matched_blocks == routed.decision.total_blocks > 0
    if algo is not HashAlgo.CONTENT:
        assert routed.features.prefix_hashes == stored_event(tok, msgs, algo).block_hashes
    else:
        assert list(routed.features.prefix_hashes) == content_chain(tok.chat_ids(msgs).ids, BS, max_blocks=2048)


async def test_removal_reset_and_restart_end_the_attraction(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, speculative_ttl_s=0.0)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(3, seed=9)
    ev = stored_event(tok, msgs)
    for name in ("r0", "r1", "r2"):
        await feed(kv, name, 0)
    seqs = {"r0": 1, "r1": 1, "r2": 1}

    async def send(name: str, *events: object) -> None:
        await feed(kv, name, seqs[name], *events)
        seqs[name] += 1

    async def matched() -> dict[str, int]:
        features = (await router.route(*chat_request(msgs))).features
        estimate = await router.store.lookup(None, features.prefix_hashes, clock.now)
        view = kv.view(estimate, features, ["r0", "r1", "r2"], clock.now)
        return {k: v for k, v in view.prefix_matches.items() if v}

    await send("r1", ev)
    assert (await matched()) == {"r1": len(ev.block_hashes)}
    await send("r1", BlockRemoved(ev.block_hashes[:1]))
    assert (await matched()) == {}  # without its first block nothing of the prefix is usable
    await send("r1", ev)
    await send("r1", AllBlocksCleared())
    assert (await matched()) == {}
    await send("r1", ev)
    await feed(kv, "r1", 0)  # the engine restarted: seq back to 0
    assert (await matched()) == {}


@pytest.mark.parametrize("ttl", [2.0, 0.0])
async def test_speculative_credit_keeps_a_burst_together_until_events_arrive(tokenizer_dir: Path, ttl: float) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, speculative_ttl_s=ttl)
    for name in ("r0", "r1", "r2"):
        await feed(kv, name, 0)
    msgs = conversation(2, seed=11)
    chosen = []
    for session in ("s1", "s2", "s3", "s4", "s5"):  # new sessions sharing one long prompt
        routed = await router.route(*chat_request(msgs, session=session))
        router.release(routed)
        chosen.append((routed.decision.replica.name, routed.decision.matched_blocks))  # type: ignore[union-attr]
        clock.now += 0.1
    total = len(routed.features.prefix_hashes)
    if ttl:
        assert chosen == [(chosen[0][0], 0)] + [(chosen[0][0], total)] * 4
        clock.now += ttl  # no BlockStored came: the credit lapses
        view = kv.view(AffinityView(), routed.features, ["r0", "r1", "r2"], clock.now)
        assert view.prefix_matches == {}
    else:  # without credit the live feeds know nothing yet: the sessions spread
        assert len({name for name, _ in chosen}) > 1 and all(m == 0 for _, m in chosen)


async def test_stale_or_silent_replicas_fall_back_to_the_estimate(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, stale_after_s=5.0, speculative_ttl_s=0.0)
    msgs = conversation(2, seed=13)
    routed = await router.route(*chat_request(msgs, session="s1"))  # no feed is live: the estimate indexes it
    chosen = routed.decision.replica.name  # type: ignore[union-attr]
    features = routed.features
    view = await router.store.lookup(None, features.prefix_hashes, clock.now)
    assert kv.view(view, features, ["r0", "r1", "r2"], clock.now).prefix_matches[chosen] == len(features.prefix_hashes)
    await feed(kv, chosen, 0)  # live now, and its events say nothing about this prompt
    assert chosen not in kv.view(view, features, ["r0", "r1", "r2"], clock.now).prefix_matches
    kv.decided(features, chosen, 0, clock.now)
    clock.now += 6.0  # sent traffic, silent: stale, the estimate answers again
    assert kv.view(view, features, ["r0", "r1", "r2"], clock.now).prefix_matches[chosen] == len(features.prefix_hashes)


async def test_models_without_tokenizer_keep_character_blocks(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, _ = kv_router(tokenizer_dir, clock)
    headers, _ = chat_request([])
    body = json.dumps({"model": "other", "messages": [{"role": "user", "content": "x" * 500}]}).encode()
    routed = await router.route(headers, body)
    assert routed.features.tokens_per_block == 0 and len(routed.features.prefix_hashes) > 0


def test_settings_validation_names_the_field() -> None:
    from extproc.config import ConfigError, config_from_mapping
    from extproc.fleet.kvevents.hashing import HashAlgo

    kv = config_from_mapping({"kv_events": {"hash_algo": "sha256_cbor", "port": 5557, "hash_seed": 0}}).kv_events
    assert (kv.port, kv.hash_algo, kv.hash_seed) == (5557, HashAlgo.SHA256_CBOR, "0")
    for raw, field in (
        ({"hash_algo": "md5"}, "kv_events.hash_algo"),
        ({"port": 0}, "kv_events.port"),
        ({"nope": 1}, "kv_events.nope"),
        ({"listen": "0.0.0.0:5557"}, "kv_events.listen"),
        ({"tokenizers": {"m": 3}}, "kv_events.tokenizers.m"),
    ):
        with pytest.raises(ConfigError, match=field):
            config_from_mapping({"kv_events": raw})


def test_lora_adapters_from_the_file_and_flags(tmp_path: Path) -> None:
    import argparse

    from extproc.config.cli_flags import add_config_flags, config_from_flags

    path = tmp_path / "router.yaml"
    path.write_text("kv_events:\n  lora_adapters: {sql-lora: m}\n")
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    kv = config_from_flags(path, parser.parse_args(["--lora-adapter", "poem-lora=m"])).kv_events
    assert kv.resolve("sql-lora") == ("m", "sql-lora") and kv.resolve("poem-lora") == ("m", "poem-lora")
    assert kv.resolve("m") == ("m", None)
    with pytest.raises(ValueError, match="--lora-adapter"):
        config_from_flags(path, parser.parse_args(["--lora-adapter", "poem-lora"]))


def test_discovered_replicas_publish_on_the_configured_ports() -> None:
    from extproc.fleet.kvevents.endpoints import replica_endpoints
    from extproc.routing.model import Replica

    settings = KvEventSettings(port=5557, replay_port=5558)
    assert replica_endpoints(Replica("pod-a", "10.1.2.3:8000"), settings) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:5558",
    )
    labelled = Replica("r", "10.1.2.4:8000", labels={"kv_events": "ipc:///x"})
    assert replica_endpoints(labelled, KvEventSettings()) == ("ipc:///x", None)
    assert replica_endpoints(Replica("pod-b", "10.1.2.5:8000"), KvEventSettings()) == (None, None)


async def test_membership_changes_follow_and_unfollow_publishers(tmp_path: Path, tokenizer_dir: Path) -> None:
    from extproc.routing.model import Replica

    members = [
        Replica(f"r{i}", f"127.0.0.1:{9000 + i}", labels={"kv_events": f"ipc://{tmp_path}/r{i}"}) for i in range(3)
    ]
    kv = EventCacheState(KvEventSettings(tokenizers={"m": str(tokenizer_dir)}), metrics=KvEventMetrics())
    router = Router(make_config(replicas=tuple(members)), kv_events=kv)
    kv.start(members)
    try:
        assert sorted(kv.subscriptions.following()) == ["r0", "r1", "r2"]
        assert kv.resolve("127.0.0.1:9001") == "r1" and kv.resolve("r2") == "r2" and kv.resolve("x") is None
        await router.fleet.set_replicas(members[:2])
        assert sorted(kv.subscriptions.following()) == ["r0", "r1"]
    finally:
        await kv.close()


async def test_predicted_and_reported_cached_tokens_are_counted_for_live_replicas(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(2, seed=21)
    await feed(kv, "r1", 0, stored_event(tok, msgs))
    kv.collect({"r1": 1000.0, "r2": 50.0})
    routed = await router.route(*chat_request(msgs))
    assert routed.decision.replica is not None and routed.decision.replica.name == "r1"
    predicted = metric_value(kv.metrics.predicted_tokens.labels("r1"))
    assert predicted == routed.decision.matched_blocks * BS > 0
    kv.collect({"r1": 1000.0 + predicted, "r2": 80.0})  # r2 has no live feed: not counted
    assert metric_value(kv.metrics.reported_tokens.labels("r1")) == predicted
    assert metric_value(kv.metrics.reported_tokens.labels("r2")) == 0


async def test_a_pin_whose_replica_lost_the_conversation_is_judged_lost(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, speculative_ttl_s=0.0)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(2, seed=23)
    ev = stored_event(tok, msgs)
    for name in ("r0", "r1", "r2"):
        await feed(kv, name, 0)
    first = await router.route(*chat_request(msgs, session="s"))
    pinned = first.decision.replica.name  # type: ignore[union-attr]
    await feed(kv, pinned, 1, ev)
    again = await router.route(*chat_request(msgs, session="s"))
    assert again.decision.reason.value == "sticky"
    await feed(kv, pinned, 2, BlockRemoved(ev.block_hashes[len(ev.block_hashes) // 3 :]))  # evicted: a third left
    estimate = await router.store.lookup("s", again.features.prefix_hashes, clock.now, model="m")
    assert estimate.pinned == pinned
    # The pin is kept, marked lost: it is worth what the replica still holds, not dropped.
    lost = kv.view(estimate, again.features, ["r0", "r1", "r2"], clock.now)
    assert lost.pinned == pinned and lost.pin_lost == "kv_events"
    kv.settings = kv.settings.model_copy(update={"unpin_below": 0.0})  # pins never judged lost
    kept = kv.view(estimate, again.features, ["r0", "r1", "r2"], clock.now)
    assert kept.pinned == pinned and kept.pin_lost is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "x"]), c, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_json, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
async def test_odd_bodies_are_routed_on_what_is_known(tokenizer_dir: Path, messages: object, path: str) -> None:
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)
    body = json.dumps({"model": "m", "messages": messages, "prompt": messages}).encode()
    try:
        routed = await router.route({":path": path}, body)
    finally:
        await kv.close()
    assert routed.decision.replica is not None


_piece = st.sampled_from(["hello", " world", "\n", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "cache", "  ", "é"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(_piece, max_size=8).map("".join), min_size=1, max_size=6))
def test_incremental_tokenizing_equals_full_on_any_turns(tokenizer_dir: Path, contents: list[str]) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    msgs: list[dict[str, str]] = []
    for i, content in enumerate(contents):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
        got = tok.chat_ids(msgs, session="s")
        assert got.ids == tuple(tok.tokenizer.encode(tok.render_chat(msgs), add_special_tokens=False).ids)


# -- checking predictions against response bodies ---------------------------------------------


async def test_response_bodies_are_streamed_to_the_processor_only_for_a_checkable_prediction(
    tokenizer_dir: Path,
) -> None:
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.conftest import body_message, headers_message, response_headers_message
    from tests.helpers import run

    streamed = pm.ProcessingMode.STREAMED

    async def answered(router: Router, msgs: list[dict[str, str]], reply: bytes) -> list[pb.ProcessingResponse]:
        headers, body = chat_request(msgs)
        return await run(
            router,
            [
                headers_message(headers),
                body_message(body),
                response_headers_message(200),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=reply[:40], end_of_stream=False)),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=reply[40:], end_of_stream=True)),
            ],
        )

    def body_modes(out: list[pb.ProcessingResponse]) -> list[int]:
        return [r.mode_override.response_body_mode for r in out if r.HasField("mode_override")]

    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(2, seed=9)
    n = len(tok.chat_ids(msgs).ids) // BS
    reply = json.dumps({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": n * BS}}}).encode()
    # Without KV events, Envoy is never asked for a response body.
    assert streamed not in body_modes(await answered(Router(make_config()), msgs, reply))
    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock, check_sample_rate=1.0)
    # With them but no live feed, nothing was predicted: the body is not asked for either.
    assert streamed not in body_modes(await answered(router, msgs, reply))
    for seq, name in enumerate(("r0", "r1", "r2")):
        await feed(kv, name, 0, stored_event(tok, conversation(1, seed=40 + seq)))
    await feed(kv, "r1", 1, stored_event(tok, msgs))
    out = await answered(router, msgs, reply)
    assert body_modes(out)[-1] == streamed  # asked in the response headers' answer
    assert [r.WhichOneof("response") for r in out][-2:] == ["response_body", "response_body"]
    checks = kv.metrics.prediction_checks
    assert metric_value(checks.labels("r1", "agree")) == 1
    # A replica reporting nothing cached where the index predicted everything: over.
    empty = reply.replace(f'"cached_tokens": {n * BS}'.encode(), b'"cached_tokens": 0')
    await answered(router, msgs, empty)
    assert metric_value(checks.labels("r1", "over")) == 1
    # Sampling off: no body again.
    router_off, kv_off = kv_router(tokenizer_dir, clock, check_sample_rate=0.0)
    await feed(kv_off, "r1", 0, stored_event(tok, msgs))
    assert streamed not in body_modes(await answered(router_off, msgs, reply))


async def test_a_previous_response_turn_is_hashed_after_the_conversation_its_engine_stores(
    tokenizer_dir: Path,
) -> None:
    clock = Clock(1000.0)
    router, _ = kv_router(tokenizer_dir, clock)
    planner = Planner(router)
    tok = PromptTokenizer(tokenizer_dir)
    headers = {":path": "/v1/responses"}
    first = {"model": "m", "instructions": "be brief", "input": "what is a cache?"}
    watch = planner.watch(can_override=True, whole_body=True, headers=headers)
    assert watch.transcript and watch.reads_body
    plan = await planner.plan(headers, json.dumps(first).encode(), watch)
    rid = plan.routed.features.response_id
    assert rid is not None and rid.startswith("resp_")  # the router named the response it will get
    assert plan.action.body is not None and json.loads(plan.action.body)["request_id"] == rid
    assert planner.response_headers(plan, {":status": "200"})
    answer = {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": "A store."}]}]}
    await planner.response_body(plan, json.dumps(answer).encode(), True)
    planner.end(plan)
    follow = {"model": "m", "instructions": "be brief", "input": "and a block?", "previous_response_id": rid}
    routed = await router.route(headers, json.dumps(follow).encode())
    # As vLLM renders it: instructions, the stored turn and its answer, then the new input.
    engine = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a cache?"},
        {"role": "assistant", "content": "A store."},
        {"role": "user", "content": "and a block?"},
    ]
    # Tokenized as vLLM 0.32 tokenizes a Responses prompt: with the tokenizer's special tokens,
    # so a second BOS before the template's (the same chat through /v1/chat/completions has one).
    ids = tok.responses_ids(engine).ids
    bos = tok.tokenizer.encode("", add_special_tokens=True).ids
    assert bos and ids == (*bos, *tok.chat_ids(engine).ids)
    assert list(routed.features.prefix_hashes) == EngineChain(HashAlgo.SHA256).hashes(ids, BS)
    # It goes where the first turn went (the only engine that stores that conversation).
    assert routed.decision.replica == plan.routed.decision.replica
    assert routed.features.conversation is not None and routed.features.conversation.match == "continued"
    # A response this router never saw: routed by its pin alone, on character blocks.
    other = await router.route(headers, json.dumps({**follow, "previous_response_id": "resp_other"}).encode())
    assert other.features.tokens_per_block == 0


async def test_a_moved_sessions_prefix_is_indexed_in_the_key_space_lookups_use(tokenizer_dir: Path) -> None:
    # With a tokenizer, live lookups use token block keys: a session moved off its replica must be
    # indexed on its new replica under those same keys, or its next turn finds nothing there.
    clock = Clock(1000.0)
    router, _ = kv_router(tokenizer_dir, clock)
    msgs = conversation(3)
    routed = await router.route(*chat_request(msgs, session="s-moved"))
    assert routed.features.tokens_per_block == BS and routed.decision.replica is not None
    source = routed.decision.replica.name
    assert await router.fleet.move_sessions_off(source) == 1
    view = await router.store.peek(routed.features.session_key, routed.features.prefix_hashes, clock(), model="m")
    assert view.pinned is not None and view.pinned != source
    assert view.prefix_matches.get(view.pinned) == len(routed.features.prefix_hashes)
