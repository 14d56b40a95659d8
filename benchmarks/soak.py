"""The soak: ten minutes (by default) at a fixed rate through real Envoy, sessions coming and going,
the processor's resident memory (``/proc/<pid>/status``) and its bounded structures (its /metrics
page: ``extproc_sessions``, ``extproc_prefix_index_blocks``, ``extproc_session_ledger_*``) sampled
every few seconds. See :mod:`extproc_lab.demo.soak` for what is run and why the bounds are scaled down.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--rate 40] [--warmup 120]
        [--out benchmarks/soak.md] [--json soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from extproc_lab.demo.soak import SoakReport, SoakSettings, run_soak

MIB = 2**20


def verdict(report: SoakReport) -> list[str]:
    """The checks the short version in the suite asserts, here reported."""
    peaks, bounds = report.peaks(), report.bounds()
    slope = report.slope_bytes_per_min()
    return [
        f"errors: {report.lost} of {report.requests:,} requests not answered 200 "
        f"(statuses {report.statuses}); stream errors {report.stream_errors:g}; "
        f"{report.skipped} ticks skipped at the concurrency cap",
        *(f"{name}: peak {peaks[name]:,} against a bound of {bounds[name]:,}" for name in peaks),
        f"processor RSS: {report.rss_warm / MIB:.1f} MiB after the {report.settings.warmup_s:g} s warm-up, "
        f"{report.rss_end / MIB:.1f} MiB at the end ({report.growth_bytes / MIB:+.1f} MiB), "
        f"at most {report.rss_max_after_warmup / MIB:.1f} MiB; fitted slope after warm-up "
        f"{slope / MIB * 10:+.2f} MiB per 10 minutes",
    ]


def markdown(report: SoakReport, command: str) -> str:
    """The report file."""
    s = report.settings
    load = os.getloadavg()
    lines = [
        "# Soak",
        "",
        f"`{command}`: {s.duration_s / 60:g} minutes at {s.rate:g} requests/s through Envoy and the processor "
        f"to {s.replicas} fake replicas (demo profile at 50x speed), {report.sessions_started:,} sessions of "
        f"{s.turns[0]}-{s.turns[1]} turns (each opening with its own ~{s.prefix_chars // 1000} KB), about "
        f"{s.pool} waiting between turns at any time. Bounds scaled down so that each is reached during the "
        f"{s.warmup_s:g} s warm-up: session TTL {s.session_ttl_s:g} s and at most {s.max_sessions:,} sessions, "
        f"{s.blocks_per_replica:,} prefix blocks per replica, {s.ledger_sessions:,} sessions in the rebalancer's "
        f"ledger. 2 cores shared with other work (load average {load[0]:.1f} at the end).",
        "",
        "## Result",
        "",
        *(f"- {line}" for line in verdict(report)),
        f"- latency: p50 {report.p50_ms} ms, p99 {report.p99_ms} ms",
        "",
        "## Samples (one a minute)",
        "",
        "| time | RSS MiB | sessions | prefix blocks | ledger sessions | ledger MiB | requests answered |",
        "|---|---|---|---|---|---|---|",
    ]
    shown, next_at = [], 0.0
    for sample in report.samples:
        if sample.at_s >= next_at:
            shown.append(sample)
            next_at = sample.at_s + 60.0
    if report.samples and shown[-1] is not report.samples[-1]:
        shown.append(report.samples[-1])
    for x in shown:
        lines.append(
            f"| {x.at_s:.0f} s | {x.rss_bytes / MIB:.1f} | {x.sessions:,} | {x.prefix_blocks:,} | "
            f"{x.ledger_sessions:,} | {x.ledger_bytes / MIB:.1f} | {x.requests:,} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run the soak and write its report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=SoakSettings().rate)
    parser.add_argument("--warmup", type=float, default=SoakSettings().warmup_s, help="seconds")
    parser.add_argument("--out", default="benchmarks/soak.md")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    settings = replace(SoakSettings(), duration_s=args.minutes * 60, rate=args.rate, warmup_s=args.warmup)
    report = asyncio.run(run_soak(settings, progress=True))
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    print("\n".join(verdict(report)))
    Path(args.out).write_text(markdown(report, command))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_dict(), indent=1, default=str))
    print(f"written to {args.out}")
    return 0 if report.lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
