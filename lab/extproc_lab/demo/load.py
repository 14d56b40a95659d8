"""Load for the fault matrix and the soak: conversations sent through the gateway, every request
recorded with its start and end time, its status and the replica that answered it.

Two shapes. :func:`closed_loop`: a fixed number of workers, each running conversations back to
back until told to stop (the fault cases: steady load while something breaks). :func:`fixed_rate`:
requests start on a fixed schedule whatever the latency, each continuing an idle conversation
or starting a new one, and conversations end after a few turns (the soak: sessions come and go).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc_lab.demo.workload import words

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODEL = "demo-model"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it; ``status`` 0 means no HTTP answer (reset, timeout), and
    ``error`` says why; for another status than 200 it holds the start of the answer's body."""

    session: str
    turn: int
    started: float
    ended: float
    status: int
    replica: str
    error: str = ""

    @property
    def ok(self) -> bool:
        """Answered 200, in full (a stream cut short has status 200 and an error)."""
        return self.status == 200 and not self.error

    @property
    def latency_s(self) -> float:
        """Seconds from send to the whole answer."""
        return self.ended - self.started


def chat_body(text: str, max_tokens: int = 2) -> bytes:
    """An OpenAI chat completion request for ``text``."""
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    ).encode()


async def send(
    http: aiohttp.ClientSession,
    url: str,
    session: str,
    turn: int,
    body: bytes,
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
    path: str = CHAT_PATH,
) -> Outcome:
    """POST one request (chat unless ``path`` says otherwise) with ``x-session-id: session``;
    never raises for transport errors."""
    started = time.monotonic()
    try:
        async with http.post(
            url + path,
            data=body,
            headers={"content-type": "application/json", "x-session-id": session, **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            payload = await resp.read()
            error = "" if resp.status == 200 else payload[:160].decode(errors="replace")
            replica = resp.headers.get("x-replica-name", "")
            return Outcome(session, turn, started, time.monotonic(), resp.status, replica, error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(session, turn, started, time.monotonic(), 0, "", type(exc).__name__)


async def send_stream(
    http: aiohttp.ClientSession,
    url: str,
    session: str,
    body: bytes,
    timeout_s: float = 30.0,
    on_headers: Callable[[str, str], None] | None = None,
    path: str = CHAT_PATH,
) -> Outcome:
    """POST a streaming request (chat unless ``path`` says otherwise) and read its server-sent
    events to the end. A stream that stops before ``data: [DONE]`` (the replica died under it) is
    status 200 with an ``error``. ``on_headers(session, replica)`` runs when the answer's headers
    arrive."""
    started = time.monotonic()
    status, replica, done = 0, "", False
    try:
        async with http.post(
            url + path,
            data=body,
            headers={"content-type": "application/json", "x-session-id": session},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status, replica = resp.status, resp.headers.get("x-replica-name", "")
            if on_headers is not None:
                on_headers(session, replica)
            async for line in resp.content:
                done = done or line.startswith(b"data: [DONE]")
        error = "" if done or status != 200 else "stream ended without [DONE]"
        return Outcome(session, 0, started, time.monotonic(), status, replica, error)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(session, 0, started, time.monotonic(), status, replica, f"{type(exc).__name__}: {exc}"[:160])


@dataclass(slots=True)
class Conversation:
    """A session's growing prompt: an opening of ``prefix_chars`` unique to it, then one line a turn."""

    session: str
    history: str
    turns_left: int
    turn: int = 0

    @classmethod
    def new(cls, session: str, prefix_chars: int, turns: int, seed: int) -> Conversation:
        """A conversation whose opening is seeded by ``seed`` (distinct sessions, distinct prefixes)."""
        opening = f"conversation {session}: " + words(random.Random(seed), max(1, prefix_chars // 4))
        return cls(session, opening, turns)

    def next_body(self) -> bytes:
        """The next turn's request (the history so far plus a new question)."""
        self.history += f"\nturn {self.turn}: and what about question {self.turn}?"
        return chat_body(self.history)


async def closed_loop(
    http: aiohttp.ClientSession,
    url: str,
    stop: asyncio.Event,
    outcomes: list[Outcome],
    *,
    workers: int = 8,
    turns: int = 6,
    prefix_chars: int = 1200,
    think_s: float = 0.02,
    tag: str = "load",
    timeout_s: float = 30.0,
) -> None:
    """``workers`` clients, each running ``turns``-turn conversations back to back until ``stop``."""

    async def worker(index: int) -> None:
        n = 0
        while not stop.is_set():
            conv = Conversation.new(f"{tag}-{index}-{n}", prefix_chars, turns, seed=index * 100_003 + n)
            n += 1
            for t in range(turns):
                if stop.is_set():
                    return
                outcomes.append(await send(http, url, conv.session, t, conv.next_body(), timeout_s))
                conv.turn += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), think_s)

    await asyncio.gather(*(worker(i) for i in range(workers)))


@dataclass(slots=True)
class RateStats:
    """What :func:`fixed_rate` did besides the requests themselves."""

    scheduled: int = 0
    skipped: int = 0  # ticks dropped because ``concurrency`` requests were already in flight
    sessions: int = 0
    max_inflight: int = 0
    inflight: int = 0
    live_sessions: int = 0


async def fixed_rate(
    http: aiohttp.ClientSession,
    url: str,
    outcomes: list[Outcome],
    *,
    rate: float,
    duration_s: float,
    concurrency: int = 64,
    pool: int = 50,
    turns: tuple[int, int] = (1, 8),
    prefix_chars: int = 2000,
    tag: str = "soak",
    seed: int = 0,
    timeout_s: float = 30.0,
    stats: RateStats | None = None,
) -> RateStats:
    """Start a request every ``1/rate`` seconds for ``duration_s`` (open loop: a slow answer does
    not slow the schedule). Each request continues the idle conversation that waited longest
    when at least ``pool`` are idle, else starts a new one; a conversation ends after a number of
    turns drawn from ``turns``. So about ``pool`` sessions live at a time while new ones keep
    arriving and old ones leave, with a think time of about ``pool / rate`` between turns."""
    rng = random.Random(seed)
    stats = stats if stats is not None else RateStats()
    idle: deque[Conversation] = deque()
    tasks: set[asyncio.Task[None]] = set()

    async def one(conv: Conversation) -> None:
        stats.inflight += 1
        stats.max_inflight = max(stats.max_inflight, stats.inflight)
        try:
            outcomes.append(await send(http, url, conv.session, conv.turn, conv.next_body(), timeout_s))
        finally:
            stats.inflight -= 1
        conv.turn += 1
        conv.turns_left -= 1
        if conv.turns_left > 0:
            idle.append(conv)

    start = time.monotonic()
    interval = 1.0 / rate
    tick = 0
    while True:
        at = start + tick * interval
        if at - start >= duration_s:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        tick += 1
        stats.scheduled += 1
        if stats.inflight >= concurrency:
            stats.skipped += 1
            continue
        if len(idle) >= pool:
            conv = idle.popleft()
        else:
            conv = Conversation.new(f"{tag}-{stats.sessions}", prefix_chars, rng.randint(*turns), seed=seed + tick)
            stats.sessions += 1
        task = asyncio.create_task(one(conv))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        stats.live_sessions = len(idle) + stats.inflight
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s + 5)
    return stats


# --- the processor's /metrics page ---------------------------------------------------------------


async def read_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Samples of a /metrics page, keyed ``name{label=value,...}`` (labels sorted, ``{}`` if none)."""
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def total(samples: dict[str, float], name: str) -> float:
    """The sum of every series of ``name`` (a counter's ``_total`` samples, say)."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


def in_rotation(replica: str) -> Callable[[dict[str, float]], bool]:
    """Predicate: the processor has ``replica`` in rotation."""
    return lambda s: s.get(f"extproc_replica_in_rotation{{replica={replica}}}") == 1.0


def out_of_rotation(replica: str) -> Callable[[dict[str, float]], bool]:
    """Predicate: the processor has taken ``replica`` out of rotation."""
    return lambda s: s.get(f"extproc_replica_in_rotation{{replica={replica}}}") == 0.0


# --- summaries -----------------------------------------------------------------------------------


def lost(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """Requests that did not get a 200."""
    return [o for o in outcomes if not o.ok]


@dataclass(slots=True)
class Stickiness:
    """How often a session's consecutive turns changed replica."""

    sessions: int = 0
    changes: int = 0
    moved_sessions: list[str] = field(default_factory=list)


def stickiness(outcomes: Iterable[Outcome], since: float = float("-inf"), until: float = float("inf")) -> Stickiness:
    """Replica changes between consecutive answered turns of each session started in [since, until)."""
    last: dict[str, str] = {}
    out = Stickiness()
    moved: set[str] = set()
    for o in sorted(outcomes, key=lambda o: o.started):
        if not o.ok or not since <= o.started < until:
            continue
        before = last.get(o.session)
        if before is not None and before != o.replica:
            out.changes += 1
            moved.add(o.session)
        last[o.session] = o.replica
    out.sessions = len(last)
    out.moved_sessions = sorted(moved)
    return out
