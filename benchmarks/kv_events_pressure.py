"""Routing on KV events under KV-cache pressure, in the simulator: our default profile on its
estimate (``extproc``), the same profile fed by the replica models' KV events after 50 ms
(``kv_events``; also with ``unpin_below: 0``, pins always kept), Dynamo's KV router
(``dynamo_kv``) and llm-d's precise prefix-cache routing (``llmd_precise``), on 8 replicas of
``llama-8b-h100`` with their KV cache cut to ``--blocks``. Below the table, per workload and size,
how far the estimate is from the events and the events from the best peer.

    .venv/bin/python benchmarks/kv_events_pressure.py [--requests 6000] [--seed 11] \\
        [--blocks 3000,6000] [--workloads multi-turn,mooncake-conversation]

The mooncake workloads read the traces shipped with the lab (``extproc_lab/sim/data/traces``;
``$EXTPROC_TRACES_DIR`` overrides).
Results go to ``benchmarks/kv_events_pressure.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from extproc.api import Config
from extproc_lab.bench.policies import KV_EVENTS, KV_EVENTS_DELAY_S, policy_profile, scrape_interval
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.figures import figures
from extproc_lab.sim.simulator import Simulation

POLICIES = ("extproc", "kv_events", "dynamo_kv", "llmd_precise", "kv_events, pins kept")


def run(workload: str, blocks: int, requests: int, seed: int, label: str) -> dict[str, float]:
    policy = KV_EVENTS if label.startswith(KV_EVENTS) else label
    profile = replace(get_profile("llama-8b-h100"), num_gpu_blocks=blocks)
    cfg = Config()
    sim = Simulation(
        WorkloadSpec(workload, seed=seed, limit=requests).build(),
        profile,
        8,
        lambda probe: policy_profile(policy, probe, seed, profile, cfg),
        policy=policy,
        config=cfg,
        scrape_interval_s=scrape_interval(policy),
        kv_events_delay_s=KV_EVENTS_DELAY_S if policy == KV_EVENTS else None,
    )
    if label.endswith("pins kept") and sim.kv_feed is not None:
        sim.kv_feed.state.settings = sim.kv_feed.state.settings.model_copy(update={"unpin_below": 0.0})
    f = figures(sim.run())
    return {"hit": f["hit_ratio"], "p50": f["ttft_p50_s"], "p99": f["ttft_p99_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--blocks", default="3000,6000")
    ap.add_argument("--workloads", default="multi-turn,mooncake-conversation")
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = ap.parse_args()
    lines = [
        "# KV events under KV-cache pressure (simulator)",
        "",
        f"`.venv/bin/python benchmarks/kv_events_pressure.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"({time.strftime('%Y-%m-%d')}): 8 replicas of llama-8b-h100, {args.requests:,} requests, seed {args.seed};",
        "TTFT in simulated seconds; hit ratio = cached prompt tokens over prompt tokens.",
        "",
        "| workload | blocks/replica | policy | hit ratio | TTFT p50 s | TTFT p99 s |",
        "|---|---:|---|---:|---:|---:|",
    ]
    out = Path(args.out)
    gaps = [
        "",
        "| workload | blocks/replica | estimate p99 / events p99 | events p99 / best peer p99 |",
        "|---|---:|---:|---:|",
    ]
    for workload in args.workloads.split(","):
        for blocks in (int(b) for b in args.blocks.split(",")):
            p99: dict[str, float] = {}
            for label in POLICIES:
                f = run(workload, blocks, args.requests, args.seed, label)
                p99[label] = f["p99"]
                row = f"| {workload} | {blocks:,} | {label} | {f['hit']:.3f} | {f['p50']:.3f} | {f['p99']:.3f} |"
                print(row, flush=True)
                lines.append(row)
                out.write_text("\n".join(lines) + "\n")  # rows so far survive an interrupted run
            best = min(p99["dynamo_kv"], p99["llmd_precise"])
            gaps.append(
                f"| {workload} | {blocks:,} | {p99['extproc'] / p99['kv_events']:.2f} | {p99['kv_events'] / best:.2f} |"
            )
    out.write_text("\n".join([*lines, *gaps]) + "\n")


if __name__ == "__main__":
    main()
