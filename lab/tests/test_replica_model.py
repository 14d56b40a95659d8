"""The replica model's invariants: blocks never over capacity, cached prompts cost no prefill,
TTFT grows with uncached tokens, batching, chunking, preemption, and the simulator's fast path."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc_lab.replica import PROFILES, KVPool, ReplicaModel, ReplicaProfile, Seq

LLAMA = PROFILES["llama-8b-h100"]
DEMO = PROFILES["demo"]


def tiny(blocks: int = 64, **changes: object) -> ReplicaProfile:
    base = ReplicaProfile("tiny", 16, blocks, 10_000.0, 0.002, 0.005, 8, 16, max_num_batched_tokens=256)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def seq(keys: tuple[int, ...], output: int = 4, extra_tokens: int = 0, name: str = "r") -> Seq:
    return Seq(name, len(keys) * 16 + extra_tokens, output, keys, 16, 16)


def drain(model: ReplicaModel, now: float = 0.0, max_steps: int = 1, check: bool = True) -> float:
    """Step until idle; checks the block invariants after every step."""
    while True:
        d = model.begin_step(now, max_steps)
        if d is None:
            return now
        now += d
        model.end_step()
        if check:
            assert_pool_consistent(model.pool)


def assert_pool_consistent(pool: KVPool) -> None:
    assert 0 <= pool.free_cached_blocks <= pool.cached_blocks
    assert pool.private_blocks >= 0
    assert pool.cached_blocks + pool.private_blocks <= pool.num_blocks
    assert 0.0 <= pool.usage <= 1.0


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(min_value=8, max_value=40),
    prompts=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3),  # which shared head
            st.integers(min_value=0, max_value=6),  # own blocks
            st.integers(min_value=0, max_value=15),  # partial tail tokens
            st.integers(min_value=1, max_value=20),  # output tokens
            st.integers(min_value=0, max_value=2),  # steps before it arrives
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_blocks_never_exceed_capacity_and_every_request_finishes(blocks: int, prompts: list[tuple[int, ...]]) -> None:
    model = ReplicaModel(tiny(blocks, max_running=6, max_num_batched_tokens=64))
    now = 0.0
    seqs = []
    for i, (head, own, tail, out, wait) in enumerate(prompts):
        keys = tuple(range(1000 * head, 1000 * head + 3)) + tuple(100_000 + 100 * i + j for j in range(own))
        s = Seq(f"r{i}", len(keys) * 16 + tail, out, keys, 16, 16)
        seqs.append(s)
        model.submit(s, now)
        for _ in range(wait):
            d = model.begin_step(now)
            if d is None:
                break
            now += d
            model.end_step()
            assert_pool_consistent(model.pool)
    drain(model, now)
    assert all(s.generated == s.output_tokens and s.finished_at >= s.first_token_at >= s.arrived_at for s in seqs)
    assert model.pool.used_blocks == 0 and model.num_running == model.num_waiting == 0
    assert model.prefix_hits_tokens <= model.prefix_queries_tokens


def test_a_fully_cached_request_recomputes_only_its_last_block() -> None:
    model = ReplicaModel(LLAMA)
    keys = tuple(range(200))  # 3,200 tokens
    first, second = seq(keys, name="a"), seq(keys, name="b")
    model.submit(first, 0.0)
    t = drain(model)
    model.submit(second, t)
    drain(model, t)
    assert first.prefill_tokens == 3200 and first.cached_tokens == 0
    # As vLLM: the last token is always computed (its logits are the answer), so a hit ends a
    # block before a prompt that is cached to its last token (KVCacheManager's num_tokens - 1).
    assert second.prefill_tokens == 16 and second.cached_tokens == 3184
    assert second.first_token_at - second.arrived_at < first.first_token_at - first.arrived_at


@pytest.mark.parametrize("max_steps", [1, 64], ids=["steps", "runs"])
def test_an_answers_full_blocks_are_cached_for_the_next_turn(max_steps: int) -> None:
    # As vLLM: every full block computed is cached, the answer's too (its last token is never
    # computed). A prompt of 10 blocks and 8 tokens, 60 tokens of answer: 68 tokens after the
    # prompt's full blocks, 67 computed, so 4 more blocks cached (the last key, ending at the
    # answer's end, is not).
    model = ReplicaModel(tiny(blocks=64))
    prompt = tuple(range(10))
    first = Seq("t1", 10 * 16 + 8, 60, (*prompt, 100, 101, 102, 103, 104), 16, 16)
    model.submit(first, 0.0)
    t = drain(model, max_steps=max_steps)
    assert [k in model.pool for k in (103, 104)] == [True, False]
    follow_up = seq((*prompt, 100, 101, 102, 103, 200, 201), name="t2")
    model.submit(follow_up, t)
    drain(model, t, max_steps=max_steps)
    assert follow_up.cached_tokens == 14 * 16


@pytest.mark.parametrize("profile", [DEMO, LLAMA], ids=["demo", "llama"])
def test_ttft_grows_with_uncached_tokens(profile: ReplicaProfile) -> None:
    model = ReplicaModel(profile)
    shared = tuple(range(200))
    model.submit(seq(shared, output=1), 0.0)
    t = drain(model)
    ttfts = []
    for own in (0, 50, 200, 600):
        s = seq(shared + tuple(10_000 * (own + 1) + j for j in range(own)), output=1, name=str(own))
        model.submit(s, t)
        t = drain(model, t)
        assert s.cached_tokens == 200 * 16 - (16 if own == 0 else 0)  # the last block recomputed
        ttfts.append(s.first_token_at - s.arrived_at)
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 4


def test_chunked_prefill_spreads_a_long_prompt_over_budgeted_steps() -> None:
    model = ReplicaModel(tiny(blocks=256, max_num_batched_tokens=256))
    long = seq(tuple(range(64)), output=2)  # 1,024 tokens: four steps of 256
    model.submit(long, 0.0)
    steps = 0
    now = 0.0
    while long.generated == 0:
        d = model.begin_step(now)
        assert d is not None
        now += d
        model.end_step()
        steps += 1
    assert steps == 4 and long.prefill_tokens == 1024


def test_decode_step_grows_with_the_batch_and_its_context() -> None:
    p = LLAMA
    one = p.step_seconds(0, 0, False, 1, 1000)
    assert one == pytest.approx(p.decode_s_per_token + 1000 * p.decode_s_per_kv_token)
    assert p.step_seconds(0, 0, False, 32, 32_000) > p.step_seconds(0, 0, False, 8, 8_000) > one
    # Prefill steps pay for attention over earlier context too.
    assert p.step_seconds(2048, 2048 * (8000 + 1024), True, 0, 0) > p.step_seconds(2048, 2048 * 1024, True, 0, 0)


def test_continuous_batching_admits_new_requests_between_decode_steps() -> None:
    model = ReplicaModel(tiny(blocks=256))
    a = seq(tuple(range(4)), output=6, name="a")
    model.submit(a, 0.0)
    now = 0.0
    for _ in range(3):  # prefill + two decode steps
        d = model.begin_step(now)
        assert d is not None
        now += d
        model.end_step()
    b = seq(tuple(range(100, 104)), output=2, name="b")
    model.submit(b, now)
    d = model.begin_step(now)
    assert d is not None
    assert model.num_running == 2  # b joined the batch while a decodes
    now += d
    model.end_step()
    assert b.generated == 1 and a.generated == 4


def test_kv_exhaustion_preempts_the_newest_and_it_recomputes() -> None:
    model = ReplicaModel(tiny(blocks=10, max_num_batched_tokens=512))
    a = seq(tuple(range(4)), output=40, name="a")  # 4 prompt blocks + 3 output blocks
    b = seq(tuple(range(100, 104)), output=40, name="b")
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    drain(model)
    assert model.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert a.generated == b.generated == 40
    # b's recomputation is prefill work again: its prompt (partly cached) and its output so far.
    assert b.prefill_tokens > 0 and model.prefill_tokens_computed > 64


def test_usage_counts_referenced_blocks_and_eviction_is_lru_of_free_blocks() -> None:
    model = ReplicaModel(tiny(blocks=12))
    for i, base in enumerate((0, 100, 200)):
        model.submit(seq(tuple(range(base, base + 4)), output=1, name=str(i)), 0.0)
        drain(model)
    assert model.kv_cache_usage_perc == 0.0 and len(model.pool) == 12
    model.submit(seq(tuple(range(300, 304)), output=1, name="d"), 0.0)
    drain(model)
    assert 0 not in model.pool and 100 in model.pool and 300 in model.pool
    # A prompt's tail is evicted before its head: blocks 3, 2, 1, 0 of the oldest prompt went first.
    assert all(k not in model.pool for k in range(4))


@pytest.mark.parametrize("blocks", [27_545, 400], ids=["roomy", "preempting"])
def test_runs_of_decode_steps_equal_stepping_one_at_a_time(blocks: int) -> None:
    profile = dataclasses.replace(LLAMA, num_gpu_blocks=blocks)

    def play(max_steps: int) -> list[float]:
        """A little event loop, as the simulator's: arrivals cut runs short and join the next step."""
        model = ReplicaModel(profile)
        seqs = [seq(tuple(range(1000 * i, 1000 * i + 40)), output=30 + 7 * i, name=str(i)) for i in range(8)]
        arrivals = [(0.0, s) for s in seqs[:5]] + [(0.05, seqs[5]), (0.3, seqs[6]), (0.31, seqs[7])]
        while True:
            if model.busy:
                if arrivals and arrivals[0][0] < model.step_end:
                    model.cut(arrivals[0][0])
                    t, s = arrivals.pop(0)
                    model.submit(s, t)
                    continue
                now = model.step_end
                model.end_step()
                model.begin_step(now, max_steps)
            elif arrivals:
                t, s = arrivals.pop(0)
                model.submit(s, t)
                if not arrivals or arrivals[0][0] > t:
                    model.begin_step(t, max_steps)
            else:
                break
        assert all(s.generated == s.output_tokens for s in seqs)
        return [t for s in seqs for t in (s.first_token_at, s.finished_at)]

    single, runs = play(1), play(1 << 20)
    assert single == pytest.approx(runs, rel=1e-9)


def test_an_oversized_prompt_is_served_without_holding_blocks() -> None:
    model = ReplicaModel(tiny(blocks=4))
    huge = seq(tuple(range(50)), output=2)
    model.submit(huge, 0.0)
    drain(model)
    assert huge.generated == 2 and huge.unbounded and model.pool.used_blocks == 0


def test_profiles_document_their_shape() -> None:
    assert LLAMA.max_num_batched_tokens == 8192 and LLAMA.max_running == 1024 and LLAMA.chunked_prefill
    assert DEMO.chunked_prefill is False
    assert LLAMA.prefill_seconds(10_000) == pytest.approx(0.008 + 0.5 + 1.5e-9 * 5e7)


# The scenario tests/e2e/test_vllm_e2e.py runs on a real engine and on this model: a cache 512 blocks of
# 32 tokens, 8 distinct prompts of 58 blocks with 160 tokens each to decode (at most 63 blocks
# each: 504 in all, they fit), then a ninth that does not fit until one finishes.
FULL_BLOCKS, FULL_PROMPT, FULL_OUTPUT, FULL_RUNNING = 512, 58 * 32, 160, 8


def test_a_cache_full_of_running_requests_reads_full_with_nothing_waiting_as_vllm_does() -> None:
    model = ReplicaModel(tiny(FULL_BLOCKS, block_size=32, max_running=256, max_num_batched_tokens=2048))

    def prompt(i: int) -> Seq:
        keys = tuple(range(1000 * (i + 1), 1000 * (i + 1) + 58))
        return Seq(f"r{i}", FULL_PROMPT, FULL_OUTPUT, keys, 32, 32)

    for i in range(FULL_RUNNING):
        model.submit(prompt(i), 0.0)
    now = 0.0
    while model.waiting or any(s.prefilling for s in model.running):
        d = model.begin_step(now)
        assert d is not None
        now += d
        model.end_step()
    # Every prompt admitted and prefilled: the cache reads full, nothing waits for room.
    assert (model.num_running, model.num_waiting) == (FULL_RUNNING, 0)
    assert model.kv_cache_usage_perc > 0.9
    # One more does not fit: it waits, and the replica takes no new work.
    model.submit(prompt(FULL_RUNNING), now)
    d = model.begin_step(now)
    assert d is not None
    model.end_step()
    assert (model.num_running, model.num_waiting) == (FULL_RUNNING, 1) and model.kv_cache_usage_perc > 0.9
    drain(model, now + d)
    # A warm but idle cache reads 0: usage counts the blocks running requests reference.
    assert model.kv_cache_usage_perc == 0.0 and model.pool.cached_blocks > 0
    assert model.preemptions == 0
