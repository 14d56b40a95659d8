"""``extproc bench routing --kv-blocks-sweep``: the same workload at several KV-cache sizes.

Production fleets run with their caches nearly full; a table at one generous size hides how a
policy behaves there. Each level is a whole :func:`~extproc_lab.bench.routing.run_bench` with the
replica profile's ``num_gpu_blocks`` set to the level; the report puts the levels side by side
with the working set over the fleet's capacity, so a reader sees how hard each level is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from extproc_lab.bench.policies import OURS, PEERS
from extproc_lab.bench.routing import BenchResult, BenchSetup, run_bench

APPROXIMATE_PEERS = ("sglang_cache_aware", "gie_default")
"""Peers that, like us, estimate the caches from their own decisions."""
TRUE_STATE_PEERS = ("dynamo_kv", "llmd_precise")
"""Peers that read the replicas' real cache state (KV events)."""


def parse_levels(text: str) -> list[int]:
    """``3000,6000,12000`` -> ``[3000, 6000, 12000]`` (each at least 1)."""
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--kv-blocks-sweep {text!r}: expected positive block counts, comma-separated")
    return levels


def run_sweep(
    setup: BenchSetup, levels: Sequence[int], policies: Sequence[str], jobs: int = 2, show_progress: bool = True
) -> list[BenchResult]:
    """One bench run per level, in order."""
    return [
        run_bench(dataclasses.replace(setup, kv_blocks=level), policies, jobs=jobs, show_progress=show_progress)
        for level in levels
    ]


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_sweep(results: Sequence[BenchResult]) -> str:
    """A Markdown table: one row per level and policy (hit ratio, TTFT p50/p99, preemptions,
    requests-per-replica spread), each level headed by its working set over capacity."""
    head = (
        "| KV blocks | working set / KV | policy | hit ratio | TTFT p50 | TTFT p99 | e2e p99 | preemptions | CV req |"
    )
    lines = [head, "|" + "|".join("---" for _ in head.strip("|").split("|")) + "|"]
    for result in results:
        w = result.workload
        level = f"{w['kv_blocks_per_replica']:,}"
        pressure = f"{w['working_set_ratio']:.2f} (peak {w['working_set_peak_ratio']:.2f})"
        for name, r in result.results.items():
            f = r.figures
            label = f"{name} *" if name == OURS else name
            lines.append(
                f"| {level} | {pressure} | {label} | {f['hit_ratio']:.1%} | {_fmt(f.get('ttft_p50_s'), '.3f')} | "
                f"{_fmt(f.get('ttft_p99_s'), '.3f')} | {_fmt(f.get('e2e_p99_s'), '.2f')} | "
                f"{_fmt(f.get('preemptions'), 'd')} | {_fmt(f.get('load_cv'), '.3f')} |"
            )
    return "\n".join(lines)


def sweep_verdict(result: BenchResult) -> list[str]:
    """The issue's targets at one level, each line saying met or missed with the figures: TTFT p99
    at most round robin's and within 10% of the best peer's; hit ratio at least the best
    approximate peer's; at 12,000 blocks and more, at least 95% of pooled."""
    res = {n: r.figures for n, r in result.results.items()}
    ours = res.get(OURS)
    if ours is None or "ttft_p99_s" not in ours:
        return []
    level = result.workload["kv_blocks_per_replica"]
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"{level:,} blocks: {'met' if ok else 'MISSED'}: {text}")

    p99 = ours["ttft_p99_s"]
    rr = res.get("round_robin")
    if rr and "ttft_p99_s" in rr:
        line(p99 <= rr["ttft_p99_s"], f"TTFT p99 {p99:.3f}s vs round robin {rr['ttft_p99_s']:.3f}s")
    peers = {n: f for n, f in res.items() if n in PEERS and "ttft_p99_s" in f}
    if peers:
        best = min(peers.items(), key=lambda kv: kv[1]["ttft_p99_s"])
        bound = best[1]["ttft_p99_s"]
        line(p99 <= bound * 1.1, f"TTFT p99 {p99:.3f}s vs best peer {best[0]} {bound:.3f}s (+10%)")
    approx = {n: f for n, f in res.items() if n in APPROXIMATE_PEERS}
    if approx:
        best = max(approx.items(), key=lambda kv: kv[1]["hit_ratio"])
        line(
            ours["hit_ratio"] >= best[1]["hit_ratio"],
            f"hit ratio {ours['hit_ratio']:.1%} vs best approximate peer {best[0]} {best[1]['hit_ratio']:.1%}",
        )
    pooled = res.get("pooled")
    if pooled and level >= 12_000 and pooled["hit_ratio"]:
        share = ours["hit_ratio"] / pooled["hit_ratio"]
        line(share >= 0.95, f"hit ratio {share:.1%} of pooled ({pooled['hit_ratio']:.1%})")
    return out
