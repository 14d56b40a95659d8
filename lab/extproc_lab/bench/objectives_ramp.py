"""``extproc bench objectives-ramp``: latency objectives over a load ramp through real Envoy,
judged by the client (issue 28).

The fleet's capacity is probed first: our gateway without objectives, fresh fake replicas, a
closed loop of many conversations with no pause, requests finished per second after a warm-up.
Then each router in turn, on fresh replicas (``LocalGateway``, the ``demo`` profile at
``time_scale``), is given an open-loop ramp of ``loads`` x that capacity:

- ``extproc_objectives``: our processor with objectives (latency models learned online from the
  first request, ``health.latency_models: auto``), the standard class shed on a predicted miss;
- ``extproc_objectives_queue`` (not run by default): the same, the standard class held in the
  router's queue instead (``on_miss: queue``);
- ``extproc_no_objectives``: our processor with ``health.latency_models: off``: the headers are
  sent but nothing acts on them;
- ``envoy_round_robin``: the same Envoy's round robin, no processor.

Workload: multi-turn chats (:func:`extproc_lab.demo.workload.multi_turn`). Conversations arrive
as a Poisson process at ``load x capacity / turns`` a second for ``seconds``; turn ``t`` of a
conversation is sent ``t x gap_s`` after it arrived, or when the answer to turn ``t-1`` ends if
that is later (a chat client sends the next message after the last answer). Each conversation is
in one class, sent as ``x-tier`` with its objectives as ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``:
``premium`` (loose objectives, ``on_miss: best_effort``: never shed) and ``standard`` (tighter).

Measured by the client only: TTFT from sending to the first streamed line (vLLM and the fake send
their headers at once and their first event with the first token), TPOT from the first byte to the
stream's end over the completion tokens after the first. A request *met* when it answered in full
within both; a 429 is a shed and counts as missed. A client gives up after ``request_timeout_s`` (a
failure). A conversation ends at its first refused or failed turn (the user leaves): its later
turns are not sent ("abandoned") and count as missed, so every router is judged on the same planned
requests. Turns not sent by the load's end (``seconds`` plus the conversation's gaps plus
``drain_s``) are not sent either and count as missed, so a run without shedding is bounded even
when its backlog is not. Goodput is the completion tokens of requests that met, over the load's
span (first send to last answer).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc_lab.bench.peer_routers import wait_serving
from extproc_lab.bench.realstack import read_counters, read_decisions
from extproc_lab.demo import load as metrics
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn
from extproc_lab.stats import percentile

OBJECTIVES = "extproc_objectives"
OBJECTIVES_QUEUE = "extproc_objectives_queue"
NO_OBJECTIVES = "extproc_no_objectives"
ROUND_ROBIN = "envoy_round_robin"
ROUTERS = (OBJECTIVES, OBJECTIVES_QUEUE, NO_OBJECTIVES, ROUND_ROBIN)
DEFAULT_ROUTERS = (OBJECTIVES, NO_OBJECTIVES, ROUND_ROBIN)
CHAT_PATH = "/v1/chat/completions"
MODEL = "demo-model"
PROFILE = "demo"
TIER_HEADER = "x-tier"
PREMIUM, STANDARD = "premium", "standard"
NOT_SENT = "not sent: the load's time was up"
ABANDONED = "not sent: an earlier turn was refused or failed"
_UNSENT = (NOT_SENT, ABANDONED)
# Counters of ours kept beside each load: what the router did with the objectives.
_SHED, _JUDGED = "extproc_requests_shed_total", "extproc_objective_requests_total"
_ERROR = "extproc_latency_prediction_error"
_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True, slots=True)
class Tier:
    """A class of conversations: its share, its objectives (milliseconds, wall clock)."""

    name: str
    share: float
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class RampSetup:
    """The fleet, the workload, the ramp and which routers."""

    replicas: int = 2
    time_scale: float = 1.0
    loads: tuple[float, ...] = (0.5, 1.0, 1.5)
    seconds: float = 20.0
    turns: int = 4
    gap_s: float = 1.0
    system_tokens: int = 300
    document_tokens: int = 1200
    followup_tokens: int = 120
    max_tokens: int = 16
    kv_blocks: int = 4096
    """KV blocks per replica (16 tokens each): room for the conversations live at 1.5x, so the
    ramp saturates compute rather than thrashing the caches (the demo profile's 1,024 hold
    about a third of them)."""
    # Premium's objectives are loose, standard's tighter: a class is shed on a miss of its own
    # objectives, so standard's set the load at which shedding starts, before premium would miss.
    premium: Tier = Tier(PREMIUM, 0.3, 1500.0, 80.0)
    standard: Tier = Tier(STANDARD, 0.7, 500.0, 40.0)
    routers: tuple[str, ...] = DEFAULT_ROUTERS
    capacity_rps: float | None = None
    """Requests per second of the fleet; probed when not given."""
    probe_s: float = 12.0
    probe_warmup_s: float = 3.0
    probe_live_per_replica: int = 8
    queue_max_wait_s: float = 5.0
    seed: int = 7
    request_timeout_s: float = 10.0
    """A client gives up on a request after this long (a failure, so a miss)."""
    drain_s: float = 5.0
    """Turns not sent by ``seconds + (turns - 1) x gap_s + drain_s`` are not sent (counted as missed):
    without shedding, an overloaded fleet's backlog would otherwise keep the run going for minutes."""
    log_dir: Path | None = None

    @property
    def tiers(self) -> tuple[Tier, Tier]:
        """Premium first."""
        return (self.premium, self.standard)

    def check(self) -> None:
        """``ValueError`` for a setup that cannot run."""
        unknown = [r for r in self.routers if r not in ROUTERS]
        if unknown:
            raise ValueError(f"unknown routers {unknown}; known: {', '.join(ROUTERS)}")
        if (
            min(self.replicas, self.turns, self.max_tokens, self.kv_blocks) < 1
            or not self.loads
            or min(self.loads) <= 0
        ):
            raise ValueError("replicas, turns, max_tokens and kv_blocks must be at least 1, loads positive")
        if self.seconds <= 0 or self.time_scale <= 0 or self.gap_s < 0:
            raise ValueError("seconds and time_scale must be positive, gap_s not negative")
        if self.capacity_rps is not None and self.capacity_rps <= 0:
            raise ValueError("capacity must be positive")


def router_config(setup: RampSetup, name: str) -> dict[str, Any]:
    """The processor's YAML for ``name`` (ours only): classes by ``x-tier``, objectives on or off."""
    classes = [{"name": t.name, "match": {"headers": {TIER_HEADER: t.name}}} for t in setup.tiers]
    if name == NO_OBJECTIVES:
        return {"classes": classes, "health": {"latency_models": "off"}}
    premium = {"priority": 2, "on_miss": "best_effort"}
    if name == OBJECTIVES_QUEUE:
        standard = {"priority": 1, "on_miss": "queue", "max_wait_s": setup.queue_max_wait_s}
        # Held for objectives only: saturation thresholds nothing reaches.
        queueing: dict[str, Any] = {"enabled": True, "kv_threshold": 1.0, "queue_threshold": 1_000_000}
    else:
        standard = {"priority": 1, "on_miss": "shed"}
        queueing = {}
    queueing.update(default=premium, classes={PREMIUM: premium, STANDARD: standard})
    return {"classes": classes, "health": {"latency_models": "auto"}, "queueing": queueing}


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    tier: str
    turn: int
    status: int = 0
    complete: bool = False
    sent_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    completion_tokens: int = 0
    done_s: float = 0.0
    error: str = ""

    def met(self, tier: Tier) -> bool:
        """Answered in full within both of its class's objectives."""
        if self.status != 200 or not self.complete:
            return False
        return self.ttft_s * 1000.0 <= tier.ttft_ms and self.tpot_s * 1000.0 <= tier.tpot_ms


async def send_turn(
    http: aiohttp.ClientSession, url: str, convo: Conversation, turn: int, tier: Tier, setup: RampSetup
) -> Outcome:
    """One streamed turn read to ``[DONE]``; the answer is added to the conversation."""
    body = {
        "model": MODEL,
        "messages": convo.next_messages(turn),
        "max_tokens": setup.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {
        "x-session-id": convo.session_id,
        TIER_HEADER: tier.name,
        "x-slo-ttft-ms": f"{tier.ttft_ms:g}",
        "x-slo-tpot-ms": f"{tier.tpot_ms:g}",
    }
    out = Outcome(tier.name, turn, sent_s=time.perf_counter())
    first: float | None = None
    last = out.sent_s
    text: list[str] = []
    try:
        async with http.post(
            url + CHAT_PATH, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=setup.request_timeout_s)
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                await resp.read()
            else:
                async for line in resp.content:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        out.complete = True
                        continue
                    last = now
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or ():
                        text.append((choice.get("delta") or {}).get("content") or "")
                    usage = chunk.get("usage")
                    if usage:
                        out.completion_tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:160]
        out.complete = False
    convo.add_answer("".join(text))
    out.done_s = time.perf_counter()
    out.ttft_s = (first if first is not None else out.done_s) - out.sent_s
    if first is not None and out.completion_tokens > 1:
        out.tpot_s = (last - first) / (out.completion_tokens - 1)
    if out.status == 200 and not out.complete and not out.error:
        out.error = "stream ended without [DONE]"
    return out


def conversations(setup: RampSetup, rate_rps: float, seed: int, run_id: str) -> list[tuple[float, Tier, Conversation]]:
    """Each conversation's arrival (seconds from the start, Poisson) and class."""
    rng = random.Random(seed)
    per_s = rate_rps / setup.turns
    count = max(1, round(per_s * setup.seconds))
    convos = multi_turn(
        count,
        setup.turns,
        seed=seed,
        system_tokens=setup.system_tokens,
        document_tokens=setup.document_tokens,
        followup_tokens=setup.followup_tokens,
        run_id=run_id,
    )
    out = []
    at = 0.0
    for convo in convos:
        tier = setup.premium if rng.random() < setup.premium.share else setup.standard
        out.append((at, tier, convo))
        at += rng.expovariate(per_s)
    return out


async def drive(url: str, setup: RampSetup, rate_rps: float, seed: int, run_id: str) -> list[Outcome]:
    """The open-loop load at ``rate_rps`` requests per second through ``url``; every outcome."""
    plan = conversations(setup, rate_rps, seed, run_id)
    outcomes: list[Outcome] = []
    start = time.perf_counter()

    deadline = start + setup.seconds + (setup.turns - 1) * setup.gap_s + setup.drain_s

    async def converse(http: aiohttp.ClientSession, at: float, tier: Tier, convo: Conversation) -> None:
        for turn in range(setup.turns):
            delay = start + at + turn * setup.gap_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() > deadline:
                _unsent(outcomes, tier, range(turn, setup.turns), NOT_SENT)
                return
            out = await send_turn(http, url, convo, turn, tier, setup)
            outcomes.append(out)
            if out.status != 200 or not out.complete:
                # A user refused (or kept waiting in vain) leaves: the rest of the chat is never sent.
                _unsent(outcomes, tier, range(turn + 1, setup.turns), ABANDONED)
                return

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(converse(http, at, tier, convo) for at, tier, convo in plan))
    return outcomes


def _unsent(outcomes: list[Outcome], tier: Tier, turns: range, why: str) -> None:
    now = time.perf_counter()
    outcomes.extend(Outcome(tier.name, turn, sent_s=now, done_s=now, error=why) for turn in turns)


async def probe(url: str, setup: RampSetup) -> float:
    """Requests per second finished by a saturated fleet: a closed loop, no pauses, after a warm-up."""
    live = setup.probe_live_per_replica * setup.replicas
    tier = setup.premium
    finished: list[float] = []
    start = time.perf_counter()
    stop = start + setup.probe_s
    index = 0

    async def loop(http: aiohttp.ClientSession) -> None:
        nonlocal index
        while time.perf_counter() < stop:
            index += 1
            convo = multi_turn(
                1,
                setup.turns,
                seed=setup.seed * 1000 + index,
                system_tokens=setup.system_tokens,
                document_tokens=setup.document_tokens,
                followup_tokens=setup.followup_tokens,
                run_id=f"probe-{index}",
            )[0]
            for turn in range(setup.turns):
                if time.perf_counter() >= stop:
                    return
                out = await send_turn(http, url, convo, turn, tier, setup)
                if out.complete:
                    finished.append(out.done_s)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(loop(http) for _ in range(live)))
    counted = [t for t in finished if t >= start + setup.probe_warmup_s]
    window = max(t for t in finished) - (start + setup.probe_warmup_s) if counted else 0.0
    if window <= 0 or not counted:
        raise RuntimeError(f"the capacity probe finished {len(finished)} requests, none after its warm-up")
    return len(counted) / window


def class_figures(outcomes: Sequence[Outcome], tier: Tier, span_s: float) -> dict[str, Any]:
    """One class at one load: met share, goodput, sheds, client TTFT."""
    mine = [o for o in outcomes if o.tier == tier.name]
    met = [o for o in mine if o.met(tier)]
    served = [o for o in mine if o.status == 200 and o.complete]
    ttfts = [o.ttft_s for o in served]
    tpots = [o.tpot_s for o in served if o.completion_tokens > 1]
    return {
        "requests": len(mine),
        "met": len(met),
        "met_share": round(len(met) / len(mine), 4) if mine else 0.0,
        "met_of_served": round(len(met) / len(served), 4) if served else 0.0,
        "served": len(served),
        "shed": sum(1 for o in mine if o.status == 429),
        "failed": sum(1 for o in mine if o.error not in _UNSENT and o.status != 429 and not o.complete),
        "abandoned": sum(1 for o in mine if o.error == ABANDONED),
        "not_sent": sum(1 for o in mine if o.error == NOT_SENT),
        "goodput_tps": round(sum(o.completion_tokens for o in met) / span_s, 2) if span_s > 0 else 0.0,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "tpot_p50_ms": round(percentile(tpots, 0.5) * 1000, 2),
        "tpot_p99_ms": round(percentile(tpots, 0.99) * 1000, 2),
    }


def load_figures(setup: RampSetup, outcomes: Sequence[Outcome], offered_rps: float) -> dict[str, Any]:
    """Every class at one load, and the whole."""
    span = (max(o.done_s for o in outcomes) - min(o.sent_s for o in outcomes)) if outcomes else 0.0
    classes = {t.name: class_figures(outcomes, t, span) for t in setup.tiers}
    errors = sorted({o.error for o in outcomes if o.error and o.error not in _UNSENT})
    return {
        "offered_rps": round(offered_rps, 2),
        "requests": len(outcomes),
        "span_s": round(span, 2),
        "goodput_tps": round(sum(c["goodput_tps"] for c in classes.values()), 2),
        "classes": classes,
        "first_errors": errors[:3],
    }


async def processor_counters(url: str) -> dict[str, dict[str, float]]:
    """Our processor's sheds and judged objectives by class (cumulative), and its latency models'
    error (p50 and p90 of the absolute relative error of their recent predictions, by replica)."""
    async with aiohttp.ClientSession() as http:
        samples = await metrics.read_metrics(http, url)
    out: dict[str, dict[str, float]] = {"shed": {}, "judged": {}, "prediction_error": {}}
    for key, value in samples.items():
        name, _, raw = key.partition("{")
        labels = dict(kv.split("=", 1) for kv in raw.rstrip("}").split(",") if "=" in kv)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if name == _SHED:
            k = f"{labels.get('class', '')}/{labels.get('reason', '')}"
            out["shed"][k] = out["shed"].get(k, 0.0) + value
        elif name == _JUDGED:
            k = f"{labels.get('class', '')}/{labels.get('outcome', '')}"
            out["judged"][k] = out["judged"].get(k, 0.0) + value
        elif name == _ERROR:
            k = f"{labels.get('replica', '')}/{labels.get('latency', '')}/p{float(labels.get('quantile', 0)) * 100:g}"
            out["prediction_error"][k] = round(value, 4)
    return out


def _gateway(setup: RampSetup, name: str) -> LocalGateway:
    log_dir = None
    if setup.log_dir is not None:
        log_dir = setup.log_dir / name
        log_dir.mkdir(parents=True, exist_ok=True)
    gw = LocalGateway(replicas=setup.replicas, profile=PROFILE, time_scale=setup.time_scale, log_dir=log_dir)
    gw.replica_args = {r.name: ("--kv-blocks", str(setup.kv_blocks)) for r in gw.members}
    if name != ROUND_ROBIN:
        config = gw.dir / "router-objectives.yaml"
        config.write_text(yaml.safe_dump(router_config(setup, name), sort_keys=False))
        gw.processor_args = ("--config", str(config))
    return gw


def _start(gw: LocalGateway, name: str) -> str:
    gw.start_replicas()
    if name != ROUND_ROBIN:
        gw.start_processor()
    gw.start_envoy()
    url = gw.round_robin_url if name == ROUND_ROBIN else gw.url
    wait_serving(url)
    return url


def _hit_ratio(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> float:
    """The replicas' own prefix-cache hit ratio over one load (tokens)."""
    hits = sum(after[n][_HITS] - before[n][_HITS] for n in after)
    queries = sum(after[n][_QUERIES] - before[n][_QUERIES] for n in after)
    return round(hits / queries, 4) if queries else 0.0


def measure_capacity(setup: RampSetup, progress: Callable[[str], None]) -> float:
    """The probe on a fleet of its own (our gateway without objectives), every process ended after."""
    gw = _gateway(setup, NO_OBJECTIVES)
    try:
        url = _start(gw, NO_OBJECTIVES)
        progress(
            f"probe: {setup.probe_live_per_replica * setup.replicas} conversations in a loop for {setup.probe_s:g} s"
        )
        return asyncio.run(probe(url, setup))
    finally:
        gw.stop()


def run_router(name: str, setup: RampSetup, capacity: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """The whole ramp through one router, on fresh replicas; every process ended after."""
    gw = _gateway(setup, name)
    try:
        url = _start(gw, name)
        loads: dict[str, Any] = {}
        for i, factor in enumerate(setup.loads):
            rate = factor * capacity
            before = asyncio.run(read_counters(gw))
            # Each load its own seed: new documents, so nothing is cached from the load before.
            outcomes = asyncio.run(drive(url, setup, rate, setup.seed + 100 * i, f"{name}-{i}"))
            row = load_figures(setup, outcomes, rate)
            row["hit_ratio"] = _hit_ratio(before, asyncio.run(read_counters(gw)))
            if name != ROUND_ROBIN:
                row["processor"] = asyncio.run(processor_counters(gw.metrics_url))
            loads[f"{factor:g}"] = row
            progress(f"{name} {factor:g}x: {json.dumps(row)}")
        out: dict[str, Any] = {"loads": loads}
        if name != ROUND_ROBIN:
            out["decisions"] = asyncio.run(read_decisions(gw.metrics_url))
        return out
    finally:
        gw.stop()


def run_ramp(setup: RampSetup, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Probe the capacity (unless given), then every router's ramp; the figures."""
    setup.check()
    started = time.monotonic()
    capacity = setup.capacity_rps
    probed = capacity is None
    if capacity is None:
        capacity = measure_capacity(setup, progress)
        progress(f"capacity: {capacity:.2f} req/s")
    routers: dict[str, Any] = {}
    for name in setup.routers:
        try:
            routers[name] = run_router(name, setup, capacity, progress)
        except (RuntimeError, TimeoutError, OSError) as exc:
            routers[name] = {"error": str(exc)}
            progress(f"{name}: failed: {exc}")
    return {
        "capacity_rps": round(capacity, 2),
        "capacity_probed": probed,
        "routers": routers,
        "setup": describe(setup),
        "wall_s": round(time.monotonic() - started, 1),
    }


def describe(setup: RampSetup) -> dict[str, Any]:
    """The setup as JSON."""
    s = asdict(setup)
    s["log_dir"] = str(setup.log_dir) if setup.log_dir is not None else None
    s["profile"] = PROFILE
    return s


def format_tables(result: dict[str, Any]) -> str:
    """Markdown: one table per class, a row per load and router; then goodput of both classes."""
    tiers = (result["setup"]["premium"], result["setup"]["standard"])
    out = []
    for tier in tiers:
        out.append(
            f"**{tier['name']}** (TTFT {tier['ttft_ms']:g} ms, TPOT {tier['tpot_ms']:g} ms, "
            f"{tier['share']:.0%} of conversations)\n"
        )
        out.append(
            "| load | router | met | met of served | shed (429) | goodput (tok/s) | TTFT p50 | TTFT p99 | TPOT p99 |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for load, name, row in _rows(result):
            if row is None:
                out.append(f"| {load}x | {name} | failed |" + " |" * 6)
                continue
            c = row["classes"][tier["name"]]
            out.append(
                f"| {load}x | {name} | {c['met_share']:.1%} ({c['met']}/{c['requests']}) | {c['met_of_served']:.1%} "
                f"| {c['shed']} | {c['goodput_tps']:.1f} | {c['ttft_p50_s'] * 1000:.0f} ms "
                f"| {c['ttft_p99_s'] * 1000:.0f} ms | {c['tpot_p99_ms']:.1f} ms |"
            )
        out.append("")
    out.append(
        "| load | router | offered (req/s) | goodput, both classes (tok/s) | requests | shed | failed or timed out "
        "| abandoned after | not sent (time up) | hit ratio | span |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for load, name, row in _rows(result):
        if row is None:
            continue
        c = row["classes"].values()
        out.append(
            f"| {load}x | {name} | {row['offered_rps']:.1f} | {row['goodput_tps']:.1f} | {row['requests']} "
            f"| {sum(x['shed'] for x in c)} | {sum(x['failed'] for x in c)} | {sum(x['abandoned'] for x in c)} "
            f"| {sum(x['not_sent'] for x in c)} | {row.get('hit_ratio', 0.0):.1%} | {row['span_s']:.0f} s |"
        )
    return "\n".join(out)


def _rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(load, router, figures) by load then router; None for a router that failed."""
    loads = [f"{x:g}" for x in result["setup"]["loads"]]
    rows: list[tuple[str, str, dict[str, Any] | None]] = []
    for load in loads:
        for name, r in result["routers"].items():
            rows.append((load, name, None if "error" in r else r["loads"].get(load)))
    return rows


def verdict(result: dict[str, Any]) -> list[str]:
    """What the objectives bought, stated plainly: met and missed against the comparison rows."""
    routers = result["routers"]
    ours = routers.get(OBJECTIVES) or routers.get(OBJECTIVES_QUEUE)
    if not ours or "error" in ours:
        return ["our router with objectives did not run"]
    lines = []
    for load, row in ours["loads"].items():
        for other in (NO_OBJECTIVES, ROUND_ROBIN):
            theirs = routers.get(other, {}).get("loads", {}).get(load)
            if theirs is None:
                continue
            p, q = row["classes"][PREMIUM]["met_share"], theirs["classes"][PREMIUM]["met_share"]
            g, h = row["goodput_tps"], theirs["goodput_tps"]
            lines.append(
                f"{load}x against {other}: premium met {p:.1%} vs {q:.1%} ({'met' if p >= q else 'MISSED'}); "
                f"goodput {g:.1f} vs {h:.1f} tok/s ({'met' if g >= h else 'MISSED'})"
            )
        shed = row["classes"][PREMIUM]["shed"]
        lines.append(f"{load}x premium shed: {shed} ({'met' if shed == 0 else 'MISSED'}: premium is never shed)")
    return lines
