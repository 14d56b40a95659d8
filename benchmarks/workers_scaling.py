"""``extproc serve --workers N`` against Envoy with ``--concurrency N``: does the processor scale?

    .venv/bin/python benchmarks/workers_scaling.py                         # 1, 2, 4 and 8 workers
    .venv/bin/python benchmarks/workers_scaling.py --workers 1,2 --seconds 8 --out benchmarks/workers_scaling.md

For each N, in turn, one gateway on 127.0.0.1 (:class:`~extproc_lab.demo.gateway.LocalGateway`):
``--replicas`` fake replicas with no model time (profile ``instant``), Envoy with ``--concurrency N``
and our processor with ``--workers N`` (the default configuration otherwise; Envoy opens one
ext_proc stream per connection, as ``extproc envoy-config`` renders it for several workers). Load
is ``wrk`` with the overhead bench's script (an 8 KB chat body, a new ``x-session-id`` each, one
token asked), ``--connections`` connections per worker over ``min(N, --wrk-threads)`` threads,
back to back for ``--seconds`` after a warm-up. Each N is measured ``--rounds`` times; the figures
are the median round's (and the range).

Columns: the requests a second through our processor, the speed-up against one worker, the
latency (p50, p99), the CPU the processor (all its workers) and Envoy used per request, how the
requests spread over the workers (each worker's share of ``extproc_decisions_total``), and the
requests a second through the same Envoy without the processor (its own round robin, the ceiling
the processor is measured under).

Every process is started on 127.0.0.1 and ended when its N is done; every run is bounded by
``--seconds`` (wrk is killed a minute past it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from extproc_lab.bench.overhead import ROUTER_PROCESSES, Wrk, cpu_seconds
from extproc_lab.bench.peer_routers import wait_serving
from extproc_lab.demo.gateway import LocalGateway

OURS = "extproc"


def decisions(url: str) -> float:
    """A worker's decisions so far (``extproc_decisions_total`` over its reasons and models)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    lines = text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("extproc_decisions_total"))


def measure_workers(workers: int, args: argparse.Namespace, wrk_binary: str) -> dict[str, Any]:
    """Every round for ``workers`` workers (and Envoy's own round robin once per round)."""
    connections = args.connections * workers
    threads = max(1, min(workers, args.wrk_threads))
    rounds: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="extproc-workers-") as tmp,
        LocalGateway(
            replicas=args.replicas,
            profile="instant",
            processor_args=("--workers", str(workers)),
            envoy_concurrency=workers,
        ) as gw,
    ):
        wrk = Wrk(wrk_binary, Path(tmp), threads=threads)
        wait_serving(gw.url)
        pids = {n: proc.pid for n, proc in gw.procs.procs.items() if proc.poll() is None}
        ours = [n for n in pids if any(n.startswith(p) for p in ROUTER_PROCESSES[OURS] if p != "envoy")]
        for _ in range(args.rounds):
            wrk.run(gw.url, args.prompt_kb, connections, args.warmup_s)
            before = [decisions(u) for u in gw.worker_metrics_urls] if workers > 1 else []
            cpu_before, started = {n: cpu_seconds(p) for n, p in pids.items()}, time.monotonic()
            top = wrk.run(gw.url, args.prompt_kb, connections, args.seconds)
            wall = time.monotonic() - started
            cpu = {n: cpu_seconds(p) - cpu_before[n] for n, p in pids.items()}
            after = [decisions(u) for u in gw.worker_metrics_urls] if workers > 1 else []
            done = [a - b for a, b in zip(after, before, strict=True)]
            direct = wrk.run(gw.round_robin_url, args.prompt_kb, connections, args.seconds / 2)
            n = top["requests"] or 1.0
            rounds.append(
                {
                    "rps": top["rps"],
                    "p50_ms": top.get("p50_ms"),
                    "p99_ms": top.get("p99_ms"),
                    "errors": top["errors"],
                    "processor_cpu_us": round(sum(cpu[p] for p in ours) / n * 1e6, 1),
                    "envoy_cpu_us": round(cpu.get("envoy", 0.0) / n * 1e6, 1),
                    "cores": {k: round(v / wall, 2) for k, v in cpu.items()},
                    "worker_shares": [round(d / sum(done), 3) for d in done] if done and sum(done) else [1.0],
                    "envoy_direct_rps": direct["rps"],
                }
            )
    return {"workers": workers, "envoy_concurrency": workers, "connections": connections, "wrk_threads": threads,
            "rounds": rounds}  # fmt: skip


def _median(rounds: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rounds if r.get(key) is not None]
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:.0f} ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else f"{mid:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per worker count, medians over its rounds with their range."""
    base = statistics.median(r["rps"] for r in results[0]["rounds"]) if results else 0.0
    lines = [
        "| workers (Envoy --concurrency) | req/s | x one worker | p50 ms | p99 ms | processor CPU us/req "
        "| Envoy CPU us/req | worker shares | Envoy alone req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        rounds = res["rounds"]
        rps = statistics.median(r["rps"] for r in rounds)
        shares = rounds[len(rounds) // 2]["worker_shares"]
        lines.append(
            f"| {res['workers']} | {_median(rounds, 'rps')} | {rps / base:.2f} | "
            f"{statistics.median(r['p50_ms'] for r in rounds):.1f} | "
            f"{statistics.median(r['p99_ms'] for r in rounds):.1f} | "
            f"{_median(rounds, 'processor_cpu_us')} | {_median(rounds, 'envoy_cpu_us')} | "
            f"{' / '.join(f'{s:.0%}' for s in shares)} | {_median(rounds, 'envoy_direct_rps')} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Measure each worker count in turn and print (or write) the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4,8", help="worker counts, comma-separated (Envoy's --concurrency too)")
    p.add_argument("--seconds", type=float, default=10.0, help="each measured run (wrk's -d)")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=16, help="wrk connections per worker")
    p.add_argument("--wrk-threads", type=int, default=4, help="at most this many wrk threads (one per worker below it)")
    p.add_argument("--replicas", type=int, default=2, help="fake replicas (profile instant) behind Envoy")
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--json", type=Path, help="also write every round here")
    p.add_argument("--out", type=Path, help="write the table here (else printed)")
    args = p.parse_args()
    counts = [int(w) for w in args.workers.split(",") if w.strip()]
    if not counts or min(counts) < 1 or args.seconds <= 0 or args.seconds > 600 or args.rounds < 1:
        p.error("worker counts must be positive, --seconds in (0, 600], --rounds at least 1")
    wrk_binary = shutil.which("wrk")
    if wrk_binary is None:
        raise SystemExit("wrk not found (Debian package wrk)")
    results = []
    for workers in counts:
        print(f"{workers} worker(s), Envoy --concurrency {workers}: measuring", flush=True)
        results.append(measure_workers(workers, args, wrk_binary))
        print(json.dumps(results[-1]), flush=True)
    text = table(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
