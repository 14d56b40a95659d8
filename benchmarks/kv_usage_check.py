"""What checking predictions against response bodies costs a streamed request.

With ``kv_events.check_sample_rate`` the processor asks Envoy for a sampled request's response
body in STREAMED mode: every chunk makes a round trip to the processor before Envoy passes it on.
This runs real Envoy, our processor and two fake vLLM replicas publishing KV events (a tokenizer
trained on the spot), twice: with the rate at 0 (bodies never read) and at 1 (every body read),
and sends the same sequence of streamed chat requests (``stream_options.include_usage``, each a
new conversation whose system prompt is shared by all) one at a time. Per request it measures the
time to the first content chunk, the mean gap between chunks, and the total time; and, at rate 1,
how the index's predictions compared with the cached tokens the replicas reported.

    .venv/bin/python benchmarks/kv_usage_check.py [--requests 200] [--max-tokens 64] [--rates 0,1]

Results go to ``benchmarks/kv_usage_check.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir, sample_text

MODEL = "demo-model"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _stream(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "first_ms": (arrivals[0] - start) * 1000 if arrivals else float("nan"),
        "gap_ms": statistics.fmean(gaps) * 1000 if gaps else 0.0,
        "total_ms": (end - start) * 1000,
    }


async def _drive(gw: LocalGateway, requests: int, max_tokens: int) -> tuple[list[dict], dict[str, float]]:
    system = sample_text(200, 1)
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(requests):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": sample_text(30, 100 + i)}]
            out.append(await _stream(http, gw.url, messages, max_tokens))
        async with http.get(gw.metrics_url) as resp:
            page = await resp.text()
    checks: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "extproc_kv_prediction_checks_total":
                checks[s.labels["outcome"]] = checks.get(s.labels["outcome"], 0.0) + s.value
    return out, checks


def run(rate: float, requests: int, max_tokens: int, tok: Path, sockets: Path) -> tuple[list[dict], dict[str, float]]:
    labels, replica_args = {}, {}
    for i in range(2):
        name = f"replica-{i}"
        pub, replay = f"ipc://{sockets}/{name}-{rate}.pub", f"ipc://{sockets}/{name}-{rate}.replay"
        labels[name] = {"kv_events": pub, "kv_replay": replay}
        replica_args[name] = ("--tokenizer", str(tok), "--kv-events", pub, "--kv-replay", replay)
    gw = LocalGateway(
        replicas=2,
        time_scale=0.01,
        labels=labels,
        replica_args=replica_args,
        processor_args=("--tokenizer", f"{MODEL}={tok}", "--kv-check-sample-rate", str(rate)),
    )
    with gw:
        return asyncio.run(_drive(gw, requests, max_tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="0,1", help="the rates, in the order run (the machine's load drifts)")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvu-") as d:
        tok = build_tokenizer_dir(Path(d) / "tok")
        for rate in (float(r) for r in args.rates.split(",")):
            results, checks = run(rate, args.requests, args.max_tokens, tok, Path(d))
            first = [r["first_ms"] for r in results]
            gap = [r["gap_ms"] for r in results]
            total = [r["total_ms"] for r in results]
            rows.append(
                f"| {rate:g} | {_pct(first, 0.5):.2f} | {_pct(first, 0.99):.2f} | {_pct(gap, 0.5):.3f} "
                f"| {_pct(total, 0.5):.1f} | {_pct(total, 0.99):.1f} | {json.dumps(checks, sort_keys=True)} |"
            )
            print(rows[-1], flush=True)
    lines = [
        "# Reading response bodies to check predictions: the cost to a stream",
        "",
        f"`.venv/bin/python benchmarks/kv_usage_check.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"({time.strftime('%Y-%m-%d')}, a shared 2-core machine): real Envoy, our processor, two fake",
        f"replicas (time scale 0.01) publishing KV events; {args.requests} streamed chat requests one at a",
        f"time, {args.max_tokens} tokens each, every chunk its own write.",
        "",
        "| check_sample_rate | first chunk p50 ms | p99 ms | mean gap between chunks p50 ms "
        "| total p50 ms | total p99 ms | prediction checks |",
        "|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
