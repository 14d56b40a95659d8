"""The agent workload as ``extproc bench realstack --workload agents`` replays it: the simulator's
requests in their closed loop, conversations told apart without a session header, and the reuse
offered, placed and captured from what the client saw."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import pytest

from extproc_lab.bench.agent_sessions import AgentCall, AgentLoad, agent_calls, last_calls, replay_calls, reuse
from extproc_lab.sim.generators import agents
from extproc_lab.sim.workload import BLOCK_TOKENS


def test_calls_are_the_generators_requests_with_conversations_told_apart() -> None:
    work = agents(12, seed=7, rate=4.0, fork_share=1.0, keyless_share=0.5)
    calls = agent_calls(work)
    assert [c.index for c in calls] == [r.index for r in work.requests]
    for c, r in zip(calls, work.requests, strict=True):
        assert (c.messages, c.session, c.keys, c.max_tokens, c.after) == (
            r.messages,
            r.session,
            r.keys,
            r.output_tokens,
            r.after,
        )
        if c.session is not None:
            # A keyed request's conversation is its session (a fork has its own).
            assert c.conversation == c.session
    keyless = [c for c in calls if c.session is None]
    forks = [c for c in calls if ".fork" in c.conversation]
    assert keyless and forks and any(c.session is None for c in forks)
    by_conversation: dict[str, list[AgentCall]] = {}
    for c in calls:
        by_conversation.setdefault(c.conversation, []).append(c)
    for turns in by_conversation.values():
        # Every conversation's turns chain: each after the one before, its messages extending them.
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.after == prev.index
            assert nxt.messages[: len(prev.messages)] == prev.messages
        first = turns[0]
        if ".fork" in first.conversation:
            # A fork starts from its parent's turn and adds a sub-task.
            parent = calls[first.after]
            assert parent.conversation != first.conversation
            assert first.messages[-1]["content"].startswith("sub-task")
    assert last_calls(calls) == {turns[-1].index for turns in by_conversation.values()}


def test_the_replay_keeps_the_closed_loop_and_its_pauses() -> None:
    calls = agent_calls(AgentLoad(agents=3, rate=40.0).workload("demo-model", 3))
    sent: dict[int, float] = {}
    answered: dict[int, float] = {}

    async def send(call: AgentCall) -> int:
        sent[call.index] = time.perf_counter()
        await asyncio.sleep(0.001)  # a send that takes real time, as a replica's answer does
        answered[call.index] = time.perf_counter()
        return call.index

    done = asyncio.run(replay_calls(calls, send, timeout_s=30.0))
    assert sorted(done.answers) == [c.index for c in calls] and not done.unanswered and not done.timed_out
    for c in calls:
        if c.after >= 0:
            # Sent its pause after the answer it follows (the sleep may run a little late, never early).
            assert sent[c.index] - answered[c.after] >= c.delay_s - 0.002
    assert done.peak_live >= 1


def test_a_replay_cut_by_its_timeout_names_what_was_not_answered() -> None:
    calls = agent_calls(AgentLoad(agents=2, rate=1.0).workload("demo-model", 7))

    async def send(call: AgentCall) -> int:
        await asyncio.sleep(0.05)  # an answer slower than the replay's 0.01 s timeout
        return call.index

    done = asyncio.run(replay_calls(calls, send, timeout_s=0.01))
    assert done.timed_out and set(done.unanswered) == {c.index for c in calls} - set(done.answers)


@dataclass
class _Seen:
    index: int
    replica: str
    sent_at: float
    first_at: float
    prompt_tokens: int
    cached_tokens: int
    ok: bool = True


def _call(index: int, keys: tuple[int, ...]) -> AgentCall:
    return AgentCall(index, -1, 0.0, [], None, f"c{index}", 8, keys, len(keys) * BLOCK_TOKENS)


def test_reuse_counts_what_some_replica_and_the_chosen_one_had_prefilled() -> None:
    b = BLOCK_TOKENS
    calls = [_call(0, (1, 2, 3)), _call(1, (1, 2, 3, 4)), _call(2, (1, 2, 5)), _call(3, (1, 2, 3, 4, 6))]
    seen = [
        _Seen(0, "r0", 0.0, 1.0, 3 * b, 0),
        # Sent before request 0's first token: nothing was offered yet.
        _Seen(1, "r1", 0.5, 1.5, 4 * b, 0),
        # Request 0's prefix (1, 2) was on r0; it went to r1, which holds (1, 2, 3, 4) by then.
        _Seen(2, "r1", 2.0, 2.5, 3 * b, 2 * b),
        # (1, 2, 3, 4) is on r1; it went to r0, which holds (1, 2, 3): the replica hit 3 blocks.
        _Seen(3, "r0", 3.0, 3.5, 5 * b, 3 * b),
    ]
    got = reuse(calls, seen)
    prompt, offered, placed, cached = 15 * b, (0 + 0 + 2 + 4) * b, (0 + 0 + 2 + 3) * b, 5 * b
    assert got["reuse_offered"] == pytest.approx(offered / prompt, abs=1e-4)
    assert got["reuse_placed"] == pytest.approx(placed / offered, abs=1e-4)
    assert got["reuse_captured"] == pytest.approx(cached / offered, abs=1e-4)


def test_a_reported_hit_counts_as_offered_and_failed_requests_do_not_count() -> None:
    b = BLOCK_TOKENS
    calls = [_call(0, (1, 2)), _call(1, (1, 2)), _call(2, (7, 8))]
    seen = [
        # Both sent at once: the client saw no prefill before request 1, but its replica hit 2 blocks.
        _Seen(0, "r0", 0.0, 1.0, 2 * b, 0),
        _Seen(1, "r0", 0.0, 1.2, 2 * b, 2 * b),
        _Seen(2, "r0", 2.0, 2.0, 2 * b, 0, ok=False),
    ]
    got = reuse(calls, seen)
    assert got == {"reuse_offered": 0.5, "reuse_placed": 1.0, "reuse_captured": 1.0}
    assert reuse(calls, []) == {"reuse_offered": None, "reuse_placed": None, "reuse_captured": None}
