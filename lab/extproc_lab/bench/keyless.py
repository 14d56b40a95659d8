"""Keyless conversations through real Envoy (issue 42): a chat workload whose conversations share
one long system prompt, sent once with a session header and once without, on fresh fake replicas.

Each conversation sends its turns in order (the next after the answer, which it appends, as a
chat client does); ``concurrency`` conversations run at once. Per run, measured by the client:

- the share of follow-up turns (turns after the first) answered by the replica that answered the
  conversation's first turn (``x-replica-name``);
- requests per replica, and the busiest replica's count over the mean and over the least busy's;
- TTFT (sending to the first streamed byte; the fake replica sends its headers with its first
  token) p50 and p99.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc_lab.bench.inference_perf import session_cost_config
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, shared_prompt_chat
from extproc_lab.stats import percentile

CHAT = "/v1/chat/completions"


@dataclass
class Turn:
    """One request as the client saw it."""

    conversation: int
    turn: int
    status: int
    replica: str
    ttft_s: float


@dataclass
class RunResult:
    """One run: every turn, and the figures computed from them."""

    mode: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def per_replica(self) -> Counter[str]:
        """Requests answered per replica."""
        return Counter(t.replica for t in self.turns if t.status == 200)

    def spread(self, replicas: int) -> tuple[float, float]:
        """The busiest replica's requests over the mean, and over the least busy's (inf when a
        replica took none)."""
        counts = [self.per_replica.get(f"replica-{i}", 0) for i in range(replicas)]
        mean = sum(counts) / len(counts) if counts else 0.0
        top = max(counts, default=0)
        low = min(counts, default=0)
        return (top / mean if mean else 0.0), (top / low if low else float("inf"))

    @property
    def followups_kept(self) -> float:
        """The share of follow-up turns answered where their conversation's first turn was."""
        first = {t.conversation: t.replica for t in self.turns if t.turn == 0 and t.status == 200}
        follow = [t for t in self.turns if t.turn > 0 and t.status == 200 and t.conversation in first]
        if not follow:
            return 0.0
        return sum(t.replica == first[t.conversation] for t in follow) / len(follow)

    @property
    def errors(self) -> int:
        """Turns that did not answer 200."""
        return sum(t.status != 200 for t in self.turns)

    def ttft(self, q: float) -> float:
        """A quantile of TTFT over the answered turns, in seconds."""
        return percentile((t.ttft_s for t in self.turns if t.status == 200), q)


async def send(
    http: aiohttp.ClientSession, url: str, conv: Conversation, turn: int, keyed: bool, max_tokens: int
) -> tuple[int, str, float]:
    """Send turn ``turn`` of ``conv`` streamed; keep the answer in it. Status, replica, TTFT."""
    body = {"model": "demo-model", "messages": conv.next_messages(turn), "max_tokens": max_tokens, "stream": True}
    headers = {"content-type": "application/json"}
    if keyed:
        headers["x-session-id"] = conv.session_id
    start = time.perf_counter()
    async with http.post(url + CHAT, data=json.dumps(body), headers=headers) as resp:
        first: float | None = None
        text: list[str] = []
        async for line in resp.content:
            if first is None:
                first = time.perf_counter() - start
            if resp.status != 200 or not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk: Any = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
        if resp.status == 200:
            conv.add_answer("".join(text))
        return resp.status, resp.headers.get("x-replica-name", ""), first if first is not None else 0.0


async def run_workload(
    url: str,
    conversations: list[Conversation],
    *,
    keyed: bool,
    concurrency: int,
    max_tokens: int = 8,
    mode: str = "",
) -> RunResult:
    """Every conversation's turns in order, ``concurrency`` conversations at a time."""
    result = RunResult(mode or ("keyed" if keyed else "keyless"))
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def converse(index: int, conv: Conversation) -> None:
            async with gate:
                for t in range(len(conv.user_turns)):
                    status, replica, ttft = await send(http, url, conv, t, keyed, max_tokens)
                    result.turns.append(Turn(index, t, status, replica, ttft))
                    if status != 200:
                        return

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    return result


@dataclass(frozen=True)
class KeylessSettings:
    """The workload and the fleet of one comparison."""

    replicas: int = 4
    sessions: int = 32
    turns: int = 6
    concurrency: int = 8
    system_words: int = 1500
    time_scale: float = 0.05
    seed: int = 11
    session_tokens: int | None = None
    """The scores profile with ``prefill_cost.session_tokens`` set to this (the price of each
    conversation live on a replica beyond its share); None: the default profile as it is."""
    token_timing: str | None = None
    """``health.token_timing`` (None: the default). The fake replica sends a stream's headers at
    once, as vLLM does, so only a timed answer keeps its prefill counted until its first token."""


def router_config(settings: KeylessSettings, conversations: bool = True) -> dict[str, Any]:
    """The router's config for a run: the default profile, or the scores profile (the default today)
    with ``session_tokens`` where set, and ``request.conversations``."""
    config: dict[str, Any] = {"request": {"conversations": conversations}}
    if settings.token_timing is not None:
        config["health"] = {"token_timing": settings.token_timing}
    if settings.session_tokens is not None:
        config.update(session_cost_config(settings.session_tokens))
    return config


def run_mode(settings: KeylessSettings, mode: str) -> RunResult:
    """One run on a fresh gateway (fresh fake replicas and processor): ``keyed`` with
    ``x-session-id``, ``keyless`` without, ``keyless_off`` without and with ``request.conversations``
    off (the router before conversations were known by their messages)."""
    convs = shared_prompt_chat(settings.sessions, settings.turns, settings.seed, settings.system_words)
    with tempfile.TemporaryDirectory(prefix="keyless-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(router_config(settings, conversations=mode != "keyless_off")))
        args = ("--config", str(path))
        with LocalGateway(replicas=settings.replicas, time_scale=settings.time_scale, processor_args=args) as gw:
            run = run_workload(gw.url, convs, keyed=mode == "keyed", concurrency=settings.concurrency, mode=mode)
            return asyncio.run(run)


def compare(settings: KeylessSettings, modes: tuple[str, ...] = ("keyed", "keyless")) -> list[RunResult]:
    """One run per mode (:func:`run_mode`), the same conversations."""
    return [run_mode(settings, mode) for mode in modes]


def table(results: list[RunResult], replicas: int) -> str:
    """The runs as a Markdown table."""
    lines = [
        "| run | requests | errors | follow-ups kept | per replica | busiest / mean | busiest / least "
        "| TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        over_mean, over_least = r.spread(replicas)
        counts = ", ".join(str(r.per_replica.get(f"replica-{i}", 0)) for i in range(replicas))
        lines.append(
            f"| {r.mode} | {len(r.turns)} | {r.errors} | {100 * r.followups_kept:.1f}% | {counts} | "
            f"{over_mean:.2f} | {over_least:.2f} | {1000 * r.ttft(0.5):.0f} ms | {1000 * r.ttft(0.99):.0f} ms |"
        )
    return "\n".join(lines)
