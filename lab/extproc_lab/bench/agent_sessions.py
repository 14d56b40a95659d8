"""The simulator's agent workload (:func:`extproc_lab.sim.generators.agents`) as an HTTP client
replays it through ``extproc bench realstack --workload agents``: one source of truth for the
requests, their order and their pauses.

The generator's requests form a closed loop: a request with ``after = j`` is sent its
``arrival_s`` (a tool pause) after request ``j``'s answer is complete, a request without one at
``arrival_s`` from the start. A fork's first turn follows the same parent turn as the parent's
next turn does, so both start when that answer is in. The messages are sent as generated (the
tool calls the generator wrote in the assistant turns, not the replica's own answer), so every
router sees the same prompts; ``max_tokens`` is the generator's answer length.

Keyless agents (``session`` None) send no ``x-session-id``; the client still knows which
conversation each request continues (a continuation adds the tool call and its result to its
predecessor's messages, a fork adds a sub-task as well), only to report how many conversations
stayed on one replica.

**Offered and captured reuse, from what the client saw.** Each request carries the keys of its
prompt's full 16-token blocks as the fake replica hashes them (``SimRequest.keys``). When a
request's first token arrives, its replica has prefilled those blocks; the client replays these
moments in time order and, at each request's send time, counts the leading blocks of its prompt
that some replica had prefilled (offered) and that the replica it went to had prefilled (placed).
No eviction is modelled, so under KV pressure "offered" is an upper bound of what the fleet still
held; a hit the replica reported proves the blocks were there, so a request's offered and placed
tokens are at least its ``cached_tokens``. "captured" is the replicas' reported hits over the
offered tokens. On real engines the block keys are the fake's text blocks (about four bytes a
token), not the engine's: the shares are scaled to the engine's own prompt tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from extproc_lab.sim.generators import agents
from extproc_lab.sim.workload import BLOCK_TOKENS, Workload


@dataclass(frozen=True, slots=True)
class AgentCall:
    """One request of the agent workload, as the client sends it."""

    index: int
    after: int
    """The request whose answer this one waits for (-1: none, sent ``delay_s`` from the start)."""
    delay_s: float
    """Seconds after ``after``'s answer (the tool pause), or from the start."""
    messages: list[dict[str, str]]
    session: str | None
    """``x-session-id``; None for a keyless agent (no header)."""
    conversation: str
    """Which conversation the request continues (the session, or a label for a keyless one)."""
    max_tokens: int
    keys: tuple[int, ...]
    """The prompt's full blocks as the fake replica hashes them (16 tokens each)."""
    text_tokens: int
    """The prompt's tokens as the fake replica counts them (the scale of ``keys``)."""


@dataclass(frozen=True, slots=True)
class AgentLoad:
    """The generator's knobs the real stack exposes; the rest are the simulator's defaults."""

    agents: int = 48
    rate: float = 4.0
    harness_tokens: int = 1500
    task_tokens: int = 500
    turns: tuple[int, int] = (8, 16)
    tool_result_tokens: tuple[int, int] = (100, 500)
    call_tokens: tuple[int, int] = (30, 90)

    def workload(self, model: str, seed: int) -> Workload:
        """The simulator's agent workload for these knobs (requests hashed for ``model``)."""
        return agents(
            self.agents,
            seed=seed,
            rate=self.rate,
            model=model,
            harness_tokens=self.harness_tokens,
            task_tokens=self.task_tokens,
            turns=self.turns,
            tool_result_tokens=self.tool_result_tokens,
            call_tokens=self.call_tokens,
        )


SMALL_AGENTS = AgentLoad(
    agents=12,
    rate=1.0,
    harness_tokens=600,
    task_tokens=150,
    turns=(4, 6),
    tool_result_tokens=(50, 200),
    call_tokens=(10, 30),
)
"""The agent workload at a size the CPU engines of ``--engine vllm`` serve (contexts under their
3,072-token limit): the same shape, a shorter harness, task and tool results, 4-6 turns."""


def agent_calls(workload: Workload) -> list[AgentCall]:
    """The workload's requests as the client sends them, in index order."""
    calls: list[AgentCall] = []
    for r in workload.requests:
        if r.messages is None:
            raise ValueError(f"request {r.index} of {workload.name} has no chat messages")
        if r.after < 0:
            conversation = r.session or f"keyless-{r.index}"
        else:
            parent = calls[r.after]
            # A continuation adds the call and the tool's result; a fork also adds its sub-task.
            continues = len(r.messages) == len(parent.messages) + 2
            conversation = r.session or (parent.conversation if continues else f"{parent.conversation}.fork{r.index}")
        calls.append(
            AgentCall(
                index=r.index,
                after=r.after,
                delay_s=r.arrival_s,
                messages=r.messages,
                session=r.session,
                conversation=conversation,
                max_tokens=r.output_tokens,
                keys=r.keys,
                text_tokens=r.prompt_tokens,
            )
        )
    return calls


def last_calls(calls: Sequence[AgentCall]) -> set[int]:
    """The requests after which their conversation sends nothing more."""
    continued = {c.after for c in calls if c.after >= 0 and calls[c.after].conversation == c.conversation}
    return {c.index for c in calls if c.index not in continued}


def distinct_tokens(calls: Sequence[AgentCall]) -> int:
    """Every distinct prompt block the workload sends, in tokens (what a fleet must hold to keep it all)."""
    return len({k for c in calls for k in c.keys}) * BLOCK_TOKENS


class Answered(Protocol):
    """What :func:`reuse` reads of one answered request."""

    index: int
    ok: bool
    replica: str
    sent_at: float
    first_at: float
    prompt_tokens: int
    cached_tokens: int


def reuse(calls: Sequence[AgentCall], turns: Sequence[Answered]) -> dict[str, Any]:
    """Offered, placed and captured reuse over the answered requests (the module's docstring says
    how they are counted)."""
    answered = {t.index: t for t in turns if t.ok and t.index >= 0}
    # Prefill moments (first token) and sends, in time order; a prefill at the very moment of a
    # send counts as before it.
    moments = sorted(
        [(t.first_at, 0, i) for i, t in answered.items()] + [(t.sent_at, 1, i) for i, t in answered.items()]
    )
    held: dict[str, set[int]] = {}
    prompt = offered = placed = cached = 0.0
    for _, kind, i in moments:
        t, keys = answered[i], calls[i].keys
        if kind == 0:
            held.setdefault(t.replica, set()).update(keys)
            continue
        matches = {name: _leading(keys, blocks) for name, blocks in held.items()}
        # The fake's blocks, scaled to the tokens the replica counted for this prompt.
        per_block = BLOCK_TOKENS * (t.prompt_tokens / calls[i].text_tokens) if calls[i].text_tokens else 0.0
        prompt += t.prompt_tokens
        cached += t.cached_tokens
        offered += max(max(matches.values(), default=0) * per_block, t.cached_tokens)
        placed += max(matches.get(t.replica, 0) * per_block, t.cached_tokens)
    return {
        "reuse_offered": round(offered / prompt, 4) if prompt else None,
        "reuse_placed": round(placed / offered, 4) if offered else None,
        "reuse_captured": round(cached / offered, 4) if offered else None,
    }


T = TypeVar("T")


@dataclass(slots=True)
class CallsReplayed(Generic[T]):
    """What :func:`replay_calls` did: the answers in the order they completed, the requests not
    answered before the timeout, and how many conversations were live at once at most."""

    answers: list[T] = field(default_factory=list)
    unanswered: list[int] = field(default_factory=list)
    peak_live: int = 0
    timed_out: bool = False
    wall_s: float = 0.0


async def replay_calls(
    calls: Sequence[AgentCall], send: Callable[[AgentCall], Awaitable[T]], timeout_s: float
) -> CallsReplayed[T]:
    """Send every call in the workload's closed loop: roots at their start time, each follower its
    pause after its predecessor's answer (whether or not that answer was good: the messages are
    the generator's). A conversation is live from its first send to its last answer."""
    out: CallsReplayed[T] = CallsReplayed()
    followers: dict[int, list[AgentCall]] = {}
    for c in calls:
        if c.after >= 0:
            followers.setdefault(c.after, []).append(c)
    ends = last_calls(calls)
    live: set[str] = set()
    answered: set[int] = set()

    async def run(call: AgentCall) -> None:
        await asyncio.sleep(call.delay_s)
        live.add(call.conversation)
        out.peak_live = max(out.peak_live, len(live))
        out.answers.append(await send(call))
        answered.add(call.index)
        if call.index in ends:
            live.discard(call.conversation)
        await asyncio.gather(*(run(f) for f in followers.get(call.index, ())))

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(run(c)) for c in calls if c.after < 0]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    out.wall_s = time.perf_counter() - started
    out.timed_out = bool(pending)
    out.unanswered = [c.index for c in calls if c.index not in answered]
    return out


def _leading(keys: Sequence[int], held: set[int]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n
