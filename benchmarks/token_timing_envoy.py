"""What timing streamed answers costs through real Envoy: the processor's CPU per request and the
client's time to first token and to the end, with ``health.token_timing: off`` and ``always``.

Two fake replicas (profile ``demo`` at ``--time-scale`` 0.2: a token every 2 ms or so, each its own
body piece as an engine's are) stream ``--tokens`` tokens for each request;
``--concurrency`` clients send ``--requests`` streamed chat requests through Envoy and our processor.
The processor's CPU is read from ``/proc/<pid>/stat`` before and after; 2 cores shared with
Envoy, the replicas and the clients, so the figures are for everything on one small machine.

    .venv/bin/python benchmarks/token_timing_envoy.py --requests 400 --tokens 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from extproc_lab.demo.gateway import LocalGateway

CHAT = "/v1/chat/completions"


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, requests: int, tokens: int, concurrency: int) -> tuple[list[float], list[float]]:
    firsts: list[float] = []
    totals: list[float] = []
    queue = list(range(requests))

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            body = {
                "model": "m",
                "stream": True,
                "max_tokens": tokens,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"question {i}"}],
            }
            started = time.perf_counter()
            first = None
            async with http.post(url + CHAT, json=body, headers={"x-session-id": f"s{i}"}) as resp:
                assert resp.status == 200, resp.status
                async for line in resp.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter() - started
            totals.append(time.perf_counter() - started)
            firsts.append(first if first is not None else totals[-1])

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return firsts, totals


def run(timing: str, args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(f'health:\n  token_timing: "{timing}"\n')
        gw = LocalGateway(
            replicas=2, profile="demo", time_scale=args.time_scale, processor_args=("--config", str(config))
        )
        with gw:
            asyncio.run(load(gw.url, 50, args.tokens, args.concurrency))  # warm up
            pid = gw.procs.procs["processor"].pid
            before = cpu_s(pid)
            firsts, totals = asyncio.run(load(gw.url, args.requests, args.tokens, args.concurrency))
            spent = cpu_s(pid) - before
    q = statistics.quantiles
    return (
        f"token_timing {timing}: processor {spent / args.requests * 1e6:.0f} us CPU/request; "
        f"client first token p50 {q(firsts, n=100)[49] * 1000:.1f} ms p99 {q(firsts, n=100)[98] * 1000:.1f} ms; "
        f"whole stream p50 {q(totals, n=100)[49] * 1000:.1f} ms p99 {q(totals, n=100)[98] * 1000:.1f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--time-scale", type=float, default=0.2, help="the fake replicas' speed (0.2: five times the profile's)"
    )
    args = p.parse_args()
    for _ in range(args.rounds):
        for timing in ("off", "always"):
            print(run(timing, args), flush=True)


if __name__ == "__main__":
    main()
