"""The fake vLLM replica: prefix cache, timing model, engine, /metrics page and HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
from aiohttp import test_utils
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from extproc_lab.replica import (
    PROFILES,
    REPLICA_HEADER,
    PrefixCache,
    ReplicaEngine,
    ReplicaProfile,
    build_app,
    count_tokens,
    get_profile,
    output_budget,
    serve_replica,
)

MODEL = "demo-model"
FAST = 0.01  # a hundred times faster than the profile: the demo answer takes ~1-3 ms
BLOCK_CHARS = 64  # 16 tokens x 4 characters


def aligned_prompt(blocks: int, tag: str = "a") -> str:
    """A prompt of exactly ``blocks`` full blocks, distinct per ``tag``."""
    unit = (tag * BLOCK_CHARS)[:BLOCK_CHARS]
    return "".join(f"{i:04d}" + unit[4:] for i in range(blocks))


class VirtualClock:
    """Injected clock and sleep: time moves only when the engine sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.gate: asyncio.Event | None = None

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:  # the virtual clock's sleeper: moves its time, waits for none
        if self.gate is not None:
            await self.gate.wait()
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)  # a loop turn, not time


def virtual_engine(profile: ReplicaProfile | None = None) -> tuple[ReplicaEngine, VirtualClock]:
    clock = VirtualClock()
    return ReplicaEngine(profile or PROFILES["demo"], clock=clock, sleep=clock.sleep), clock


# --- prefix cache -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(min_value=1, max_value=12),
    requests=st.lists(st.lists(st.integers(min_value=0, max_value=30), max_size=20), max_size=30),
)
def test_cache_never_exceeds_capacity(capacity: int, requests: list[list[int]]) -> None:
    cache = PrefixCache(num_gpu_blocks=capacity, block_size=16)
    for hashes in requests:
        cached = cache.match_and_store(hashes)
        assert 0 <= cached <= len(hashes)
        assert len(cache) <= capacity
        # What was just stored (up to the capacity) is all there afterwards.
        assert all(h in cache for h in hashes[:capacity])
    assert cache.hits_tokens <= cache.queries_tokens


def test_repeated_prompt_is_a_full_hit() -> None:
    cache = PrefixCache(num_gpu_blocks=64)
    hashes = cache.hashes_for(aligned_prompt(5), MODEL)
    assert len(hashes) == 5
    assert cache.match_and_store(hashes, prompt_tokens=80) == 0
    assert cache.match_and_store(hashes, prompt_tokens=80) == 5
    assert (cache.queries_tokens, cache.hits_tokens) == (160, 80)


def test_shared_prefix_hits_up_to_first_difference_and_models_do_not_share() -> None:
    cache = PrefixCache(num_gpu_blocks=64)
    cache.match_and_store(cache.hashes_for(aligned_prompt(4) + aligned_prompt(2, "x"), MODEL))
    assert cache.match_and_store(cache.hashes_for(aligned_prompt(4) + aligned_prompt(2, "y"), MODEL)) == 4
    assert cache.match_and_store(cache.hashes_for(aligned_prompt(4), "other-model")) == 0


def test_eviction_drops_least_recent_and_a_prompt_tail_before_its_head() -> None:
    cache = PrefixCache(num_gpu_blocks=4)
    cache.match_and_store([1, 2])
    cache.match_and_store([3, 4])
    cache.match_and_store([5])
    assert 2 not in cache and 1 in cache
    cache.match_and_store([6, 7])
    assert [h for h in range(1, 8) if h in cache] == [3, 5, 6, 7]


def test_reset_drops_blocks_keeps_counters() -> None:
    cache = PrefixCache(num_gpu_blocks=8)
    cache.match_and_store([1, 2, 3])
    cache.match_and_store([1, 2, 3])
    cache.reset()
    assert len(cache) == 0
    assert cache.hits_tokens == 48
    assert cache.match_and_store([1, 2, 3]) == 0


def test_count_tokens_approximates_four_characters() -> None:
    assert count_tokens("") == 1
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2
    assert count_tokens(aligned_prompt(3)) == 48


# --- timing profiles and output budget -------------------------------------------------------


def test_demo_profile_figures() -> None:
    demo = PROFILES["demo"]
    assert 0.15 <= demo.prefill_seconds(2000) <= 0.25
    assert demo.prefill_seconds(0) < 0.01
    assert demo.default_output_tokens == 16
    assert demo.decode_s_per_token == pytest.approx(0.005)
    llama = PROFILES["llama-8b-h100"]
    assert 10_000 <= llama.prefill_tokens_per_s <= 20_000
    assert 0.010 <= llama.decode_s_per_token <= 0.015


def test_get_profile_scales_and_rejects_unknown_names() -> None:
    assert get_profile("demo", 0.1).time_scale == 0.1
    assert get_profile("demo").time_scale == 1.0
    with pytest.raises(ValueError, match="llama-8b-h100"):
        get_profile("nope")
    with pytest.raises(ValueError):
        get_profile("demo", 0.0)


def test_output_budget() -> None:
    assert output_budget(16) == (16, "stop")
    assert output_budget(16, max_tokens=4) == (4, "length")
    assert output_budget(16, max_tokens=100) == (16, "stop")
    assert output_budget(16, max_tokens=100, min_tokens=20) == (20, "stop")
    assert output_budget(16, max_tokens=100, ignore_eos=True) == (100, "length")
    assert output_budget(16, max_tokens=10**9, ignore_eos=True) == (4096, "length")


# --- engine ------------------------------------------------------------------------------------


async def test_a_fully_cached_request_recomputes_only_its_last_block() -> None:
    engine, _ = virtual_engine()
    demo = engine.profile
    prompt = aligned_prompt(10)
    first = await engine.generate(prompt, MODEL, max_tokens=1)
    second = await engine.generate(prompt, MODEL, max_tokens=1)
    assert first.cached_tokens == 0
    assert first.ttft_s == pytest.approx(demo.prefill_seconds(160))
    # As vLLM: the last token is always computed, so the hit ends a block before it.
    assert second.prompt_tokens == 160 and second.cached_tokens == 144
    assert second.ttft_s == pytest.approx(demo.prefill_seconds(16))
    assert second.ttft_s < first.ttft_s


async def test_ttft_grows_with_uncached_tokens() -> None:
    engine, _ = virtual_engine()
    ttfts = [
        (await engine.generate(aligned_prompt(blocks, tag), MODEL, max_tokens=1)).ttft_s
        for blocks, tag in ((1, "a"), (10, "b"), (50, "c"), (125, "d"))
    ]
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 4
    # 125 blocks = 2,000 tokens: about 0.2 s on the demo profile.
    assert ttfts[-1] == pytest.approx(0.203)


async def test_partly_cached_prompt_prefills_only_the_rest() -> None:
    engine, _ = virtual_engine()
    await engine.generate(aligned_prompt(100), MODEL, max_tokens=1)
    gen = await engine.generate(aligned_prompt(100) + aligned_prompt(25, "z"), MODEL, max_tokens=1)
    assert gen.cached_tokens == 1600
    assert gen.ttft_s == pytest.approx(engine.profile.prefill_seconds(400))


async def test_prefill_is_serialised_so_a_queue_raises_ttft() -> None:
    engine, clock = virtual_engine()
    clock.gate = asyncio.Event()
    tasks = [asyncio.create_task(engine.generate(aligned_prompt(125, tag), MODEL, max_tokens=1)) for tag in "xyz"]
    for _ in range(5):
        await asyncio.sleep(0)  # a loop turn, not time
    assert (engine.running, engine.waiting) == (1, 2)
    clock.gate.set()
    gens = await asyncio.gather(*tasks)
    assert [g.ttft_s for g in gens] == pytest.approx([0.203, 0.406, 0.609])
    assert (engine.running, engine.waiting) == (0, 0)


async def test_decode_emits_tokens_one_step_apart() -> None:
    engine, clock = virtual_engine()
    seen: list[tuple[int, str, float]] = []

    async def on_token(index: int, text: str) -> None:
        seen.append((index, text, clock.now))

    gen = await engine.generate("hello", MODEL, on_token=on_token)
    assert [i for i, _, _ in seen] == list(range(16))
    assert "".join(t for _, t, _ in seen) == gen.text
    assert seen[-1][2] - seen[0][2] == pytest.approx(15 * 0.005)
    assert (gen.completion_tokens, gen.finish_reason) == (16, "stop")
    assert gen.e2e_s == pytest.approx(gen.ttft_s + 15 * 0.005)


async def test_aborted_request_releases_its_slot_and_blocks() -> None:
    engine, _ = virtual_engine()

    async def hang_up(index: int, text: str) -> None:
        if index == 3:
            raise ConnectionResetError

    with pytest.raises(ConnectionResetError):
        await engine.generate(aligned_prompt(4), MODEL, on_token=hang_up)
    assert engine.finished["abort"] == 1
    assert (engine.running, engine.waiting) == (0, 0)
    # As in vLLM, usage counts blocks referenced by requests: the prompt's 4 blocks stay cached
    # (a later request can hit them) but are free.
    assert engine.kv_cache_usage_perc == 0.0
    assert len(engine.cache) == 4


async def test_kv_exhaustion_preempts_and_usage_counts_referenced_blocks() -> None:
    tiny = ReplicaProfile("tiny", 16, 4, 10_000.0, 0.001, 0.005, 16, 8)
    engine, _ = virtual_engine(tiny)
    usage: list[float] = []

    async def sample(index: int, text: str) -> None:
        usage.append(engine.kv_cache_usage_perc)

    # Each request needs 2 prompt blocks + 1 output block; two at once need 6 of the 4 blocks,
    # so the second is preempted when the first needs its output block, and recomputed later.
    gens = await asyncio.gather(
        engine.generate(aligned_prompt(2, "p"), MODEL, on_token=sample),
        engine.generate(aligned_prompt(2, "q"), MODEL, on_token=sample),
    )
    assert [g.completion_tokens for g in gens] == [16, 16]
    assert engine.preemptions == 1
    assert max(usage) == 1.0
    assert engine.kv_cache_usage_perc == 0.0  # idle: every block is free (some still cached)
    assert 0 < len(engine.cache) <= 4


# --- /metrics ------------------------------------------------------------------------------------

METRIC_SAMPLES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:cache_config_info",
}


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return next(v for lbl, v in samples[name] if labels.items() <= lbl.items())


async def test_metrics_page_parses_with_vllm_names_and_values() -> None:
    engine, _ = virtual_engine()
    prompt = aligned_prompt(10)
    await engine.generate(prompt, MODEL)
    await engine.generate(prompt, MODEL, max_tokens=2)
    text = engine.metrics_text(MODEL).decode()
    assert "# HELP vllm:prefix_cache_hits_total " in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    samples = parse_metrics(text)
    assert set(samples) >= METRIC_SAMPLES
    for name in METRIC_SAMPLES:
        for labels, _ in samples[name]:
            assert labels.get("model_name", MODEL) == MODEL and labels["engine"] == "0", name
            assert ("model_name" in labels) == (name != "vllm:cache_config_info"), name  # as vLLM writes it
    assert value(samples, "vllm:prefix_cache_queries_total") == 320
    assert value(samples, "vllm:prefix_cache_hits_total") == 144  # the last block recomputed, as vLLM
    assert value(samples, "vllm:prompt_tokens_total") == 320
    assert value(samples, "vllm:generation_tokens_total") == 18
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert value(samples, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert value(samples, "vllm:time_to_first_token_seconds_bucket", le="0.005") == 1
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0  # idle: the cached blocks are free
    info = samples["vllm:cache_config_info"][0]
    assert info == (
        {
            "engine": "0",
            "block_size": "16",
            "cache_dtype": "auto",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(PROFILES["demo"].num_gpu_blocks),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "sha256",
        },
        1.0,
    )


# --- HTTP ------------------------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[test_utils.TestClient]:
    engine = ReplicaEngine(get_profile("demo", FAST))
    server = test_utils.TestServer(build_app(engine, "replica-a", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(server) as c:
        yield c


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def read_sse(resp: Any) -> list[Any]:
    """The data payloads of an SSE response, ``[DONE]`` kept as a string."""
    raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


async def test_chat_completion(client: test_utils.TestClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body("hello there", temperature=0.2))
    assert resp.status == 200
    assert resp.headers[REPLICA_HEADER] == "replica-a"
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["system_fingerprint"] == "replica-a"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].startswith("The replica answers")
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_streaming_chat_with_usage(client: test_utils.TestClient) -> None:
    body = chat_body("stream me", stream=True, stream_options={"include_usage": True}, max_tokens=5)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers[REPLICA_HEADER] == "replica-a"
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["system_fingerprint"] == "replica-a" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "The replica answers with plain"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_completions_plain_and_streaming(client: test_utils.TestClient) -> None:
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 3})
    body = await resp.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "The replica answers"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3

    resp = await client.post("/v1/completions", json={"prompt": ["Once", " upon"], "stream": True})
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).startswith("The replica answers")
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_second_identical_request_reports_cached_tokens(client: test_utils.TestClient) -> None:
    body = chat_body("a long shared system prompt " * 40, max_completion_tokens=2)
    first = await (await client.post("/v1/chat/completions", json=body)).json()
    second = await (await client.post("/v1/chat/completions", json=body)).json()
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens // 16 * 16 > 0
    assert second["usage"]["completion_tokens"] == 2


async def test_reset_prefix_cache(client: test_utils.TestClient) -> None:
    body = chat_body("x" * 400, max_tokens=1)
    await client.post("/v1/chat/completions", json=body)
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 200
    assert resp.headers[REPLICA_HEADER] == "replica-a"
    again = await (await client.post("/v1/chat/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        json.dumps({"model": MODEL}).encode(),
        json.dumps(chat_body("hi", max_tokens=0)).encode(),
        json.dumps(chat_body("hi", max_tokens="many")).encode(),
    ],
)
async def test_malformed_body_is_400_with_openai_error(client: test_utils.TestClient, raw: bytes) -> None:
    resp = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert resp.headers[REPLICA_HEADER] == "replica-a"
    error = (await resp.json())["error"]
    assert error["message"] and error["type"] == "BadRequestError" and error["code"] == 400


async def test_models_health_metrics_and_header_everywhere(client: test_utils.TestClient) -> None:
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = await client.get("/health")
    assert health.status == 200 and health.headers[REPLICA_HEADER] == "replica-a"
    missing = await client.get("/nope")
    assert missing.status == 404 and missing.headers[REPLICA_HEADER] == "replica-a"
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    metrics = await client.get("/metrics")
    assert metrics.headers["Content-Type"].startswith("text/plain")
    samples = parse_metrics(await metrics.text())
    assert set(samples) >= METRIC_SAMPLES
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1


async def test_client_hanging_up_a_stream_counts_an_abort(client: test_utils.TestClient) -> None:
    body = {"prompt": "hi", "stream": True, "max_tokens": 2000, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()
    for _ in range(100):
        samples = parse_metrics(await (await client.get("/metrics")).text())
        if value(samples, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        await asyncio.sleep(0.01)  # real time: the abort counted by the replica's server
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(samples, "vllm:num_requests_running") == 0


def _connectable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_serve_replica_with_the_openai_client() -> None:
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_replica("replica-z", "127.0.0.1", 0, time_scale=FAST, ready=ready))
    port = await asyncio.wait_for(ready, 5)
    try:
        async with httpx2.AsyncClient(trust_env=False) as http:
            api = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http, max_retries=0
            )
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi " * 50}]
            )
            assert raw.headers[REPLICA_HEADER] == "replica-z"
            assert raw.parse().system_fingerprint == "replica-z"
            stream = await api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi " * 50}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            usage = chunks[-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not _connectable(port)


async def test_serve_replica_with_fewer_kv_blocks_reports_and_evicts_within_them() -> None:
    """``extproc replica --kv-blocks``: the cache holds that many blocks, and says so."""
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_replica("replica-k", "127.0.0.1", 0, time_scale=FAST, ready=ready, kv_blocks=32))
    port = await asyncio.wait_for(ready, 5)

    async def cached(http: httpx2.AsyncClient, text: str) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        answer = (await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)).json()
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    try:
        async with httpx2.AsyncClient(trust_env=False) as http:
            info = parse_metrics((await http.get(f"http://127.0.0.1:{port}/metrics")).text)["vllm:cache_config_info"]
            assert info[0][0]["num_gpu_blocks"] == "32"
            first, second = "alpha beta gamma " * 90, "delta epsilon zeta " * 90  # ~20 blocks each
            assert await cached(http, first) == 0
            held = await cached(http, first)
            assert held >= 16 * 16  # held while it fits
            assert await cached(http, second) == 0
            # 20 more blocks do not fit beside it in 32, so (its tail first, as vLLM frees them) it
            # lost blocks; with the profile's 1,024 blocks it would all still be there.
            assert await cached(http, first) < held
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_serve_replica_reports_a_bad_profile_to_ready() -> None:
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(ValueError, match="unknown replica profile"):
        await serve_replica("r", "127.0.0.1", 0, profile_name="nope", ready=ready)
    with pytest.raises(ValueError):
        ready.result()
