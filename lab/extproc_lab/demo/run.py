"""``extproc demo``: real Envoy, the processor and fake replicas on loopback; a multi-turn chat
workload replayed through Envoy with the ``openai`` client, once with our routing and once with
Envoy's own round robin; the figures printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn
from extproc_lab.engines.fleet import EngineSettings
from extproc_lab.stats import percentile


@dataclass
class Sample:
    """One request's outcome."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    session: str
    ok: bool = True


@dataclass
class PolicyResult:
    """Figures for one routing policy."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    def figures(self) -> dict[str, Any]:
        """The JSON shape of ``--json``."""
        ok = self.ok
        prompt = sum(s.prompt_tokens for s in ok)
        ttfts = sorted(s.ttft_s for s in ok)
        return {
            "hit_ratio": round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
            "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
            "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else 0.0,
            "requests": len(self.samples),
            "errors": len(self.samples) - len(ok),
            "requests_per_replica": dict(sorted(Counter(s.replica for s in ok).items())),
            "sessions_on_one_replica": sessions_on_one_replica(ok),
            "wall_s": round(self.wall_s, 2),
        }


def sessions_on_one_replica(samples: list[Sample]) -> float:
    """Share of sessions whose turns all landed on one replica."""
    by_session: dict[str, set[str]] = {}
    for s in samples:
        by_session.setdefault(s.session, set()).add(s.replica)
    if not by_session:
        return 0.0
    return round(sum(len(r) == 1 for r in by_session.values()) / len(by_session), 4)


async def _one_turn(client: Any, convo: Conversation, turn: int, model: str) -> Sample:
    messages = convo.next_messages(turn)
    start = time.perf_counter()
    ttft = None
    replica = "?"
    usage = None
    text: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=16,
        extra_headers={"x-session-id": convo.session_id},
    )
    async for chunk in stream:
        if chunk.system_fingerprint:
            replica = chunk.system_fingerprint
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    convo.add_answer("".join(text))
    cached = 0
    prompt_tokens = 0
    if usage is not None:
        prompt_tokens = usage.prompt_tokens
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
    return Sample(
        ttft if ttft is not None else time.perf_counter() - start, prompt_tokens, cached, replica, convo.session_id
    )


async def replay(
    base_url: str, conversations: list[Conversation], turns: int, model: str, stagger_s: float = 0.1
) -> PolicyResult:
    """Replay the conversations concurrently, each one's turns in order; conversation ``i`` starts
    ``i * stagger_s`` seconds in, as users arrive over time rather than all in the same instant."""
    from openai import AsyncOpenAI

    result = PolicyResult()
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="demo", max_retries=0, timeout=120)

    async def converse(index: int, convo: Conversation) -> None:
        await asyncio.sleep(index * stagger_s)
        for turn in range(turns):
            try:
                result.samples.append(await _one_turn(client, convo, turn, model))
            except Exception:
                result.samples.append(Sample(0.0, 0, 0, "error", convo.session_id, ok=False))

    start = time.perf_counter()
    await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    result.wall_s = time.perf_counter() - start
    await client.close()
    return result


def reset_caches(gateway: LocalGateway) -> None:
    """Empty every replica's prefix cache (vLLM's POST /reset_prefix_cache; real engines serve it in
    dev mode, which :func:`~extproc_lab.engines.fleet.engine_env` turns on)."""
    for r in gateway.members:
        req = urllib.request.Request(f"http://{r.address}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=5):
            pass


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table the demo prints."""
    lines = [f"{'policy':<14}{'KV hit ratio':>14}{'TTFT p50':>11}{'TTFT p99':>11}{'errors':>8}  requests per replica"]
    for name, f in results.items():
        per = " ".join(f"{k}={v}" for k, v in f["requests_per_replica"].items())
        ttft = f"{f['ttft_p50_s']:>10.3f}s{f['ttft_p99_s']:>10.3f}s"
        lines.append(f"{name:<14}{f['hit_ratio']:>14.1%}{ttft}{f['errors']:>8}  {per}")
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    """Start the gateway, replay the workload under both policies, print and optionally write figures."""
    model = "demo-model"
    engine = getattr(args, "engine", "fake")
    vllm = engine == "vllm"
    # Real engines start in tens of seconds each on a small machine: fewer, and a shorter workload.
    for name, fake, real in (("replicas", 8, 3), ("sessions", 24, 12), ("turns", 8, 4)):
        if getattr(args, name, None) is None:
            setattr(args, name, real if vllm else fake)
    kind = "real vLLM CPU engines (about a minute to start)" if vllm else "fake vLLM replicas"
    print(f"starting Envoy, the processor and {args.replicas} {kind} on 127.0.0.1 ...", flush=True)
    results: dict[str, dict[str, Any]] = {}
    settings = EngineSettings(max_model_len=4096)
    with LocalGateway(replicas=args.replicas, mode=args.mode, engine=engine, engine_settings=settings) as gw:
        for name, url in (("extproc", gw.url), ("round_robin", gw.round_robin_url)):
            reset_caches(gw)
            convos = multi_turn(args.sessions, args.turns, seed=args.seed, run_id=name)
            print(f"replaying {args.sessions} sessions x {args.turns} turns through Envoy ({name}) ...", flush=True)
            results[name] = asyncio.run(replay(url, convos, args.turns, model, args.stagger)).figures()
    print()
    print(format_table(results))
    ours, rr = results["extproc"], results["round_robin"]
    if rr["hit_ratio"] > 0:
        print(
            f"\nKV hit ratio x{ours['hit_ratio'] / rr['hit_ratio']:.1f} against round robin; "
            f"TTFT p99 {ours['ttft_p99_s']:.3f}s against {rr['ttft_p99_s']:.3f}s; "
            f"sessions kept on one replica: {ours['sessions_on_one_replica']:.0%} against "
            f"{rr['sessions_on_one_replica']:.0%}"
        )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"policies": results}, indent=2) + "\n")
        print(f"figures written to {args.json_path}")
    return 0 if ours["errors"] == 0 and rr["errors"] == 0 else 1
