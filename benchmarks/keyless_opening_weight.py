"""What a running keyless opening should count at (``OPENING_WEIGHT`` in
:mod:`extproc.fleet.health.sessions`), in the simulator: for each weight, the keyless first wave
(:mod:`extproc_lab.bench.keyless`'s shape: 32 keyless conversations of 6 turns, 8 at a time,
sharing a 2,000-token system prompt, on 4 `demo` replicas; the busiest replica's requests over the
mean, at three workload seeds) and the shared-prefix table (its single requests open keyless
conversations that never come back; hit ratio and TTFT p99 at several router seeds, which the
keyless conversations' identities and so the ring's tie-break follow). A weight of -1 is the rule
without it (a running opening at the return rate alone, 0 before any came back). Results:
benchmarks/keyless_conversations.md.

    .venv/bin/python benchmarks/keyless_opening_weight.py [--weights=-1,0.1,0.25,0.5,1] [--router-seeds 1,2,3,4,5,6,7]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

from extproc.api import Config
from extproc_lab.bench.policies import policy_profile, scrape_interval
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.figures import figures
from extproc_lab.sim.generators import shared_system_chat
from extproc_lab.sim.simulator import Simulation

RATE_ONLY = -1.0


def first_wave(seed: int, weight: float) -> float:
    """The keyless first wave's busiest replica over the mean (requests)."""
    replica, cfg = get_profile("demo"), Config()
    short = {"document_tokens": 20, "followup_tokens": 10, "max_tokens": 8}
    wl = shared_system_chat(32, 6, seed=seed, live=8, stagger_s=0.0, system_tokens=2000, keyed=False, **short)
    sim = Simulation(wl, replica, 4, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg)
    sim.driver.set_opening_weight(weight)
    per_replica = Counter(o.replica for o in sim.run().outcomes)
    return max(per_replica.values()) / (len(wl) / 4)


def shared_prefix(router_seed: int, weight: float) -> tuple[float, float]:
    """The shared-prefix table's row (seed 7, 8 `llama-8b-h100` replicas) at ``router_seed``:
    hit ratio and TTFT p99 (s)."""
    replica, cfg = get_profile("llama-8b-h100"), Config()
    wl = WorkloadSpec(name="shared-prefix", seed=7).build()
    sim = Simulation(
        wl,
        replica,
        8,
        lambda probe: policy_profile("extproc", probe, 7, replica, cfg),
        policy="extproc",
        config=cfg,
        scrape_interval_s=scrape_interval("extproc"),
        seed=router_seed,
    )
    sim.driver.set_opening_weight(weight)
    figs = figures(sim.run())
    return float(figs["hit_ratio"]), float(figs["ttft_p99_s"])


def main() -> None:
    """Print one row per weight."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="-1,0.1,0.25,0.5,1")
    p.add_argument("--router-seeds", default="1,2,3,4,5,6,7")
    p.add_argument("--wave-seeds", default="7,8,9")
    args = p.parse_args()
    seeds = [int(s) for s in args.router_seeds.split(",")]
    print(
        "| running opening counts at | first wave: busiest / mean | shared-prefix hit (mean; range) "
        "| shared-prefix TTFT p99 (mean; range) |"
    )
    print("|---|---|---|---|")
    for weight in (float(w) for w in args.weights.split(",")):
        at = 0.0 if weight == RATE_ONLY else weight
        waves = [first_wave(int(s), at) for s in args.wave_seeds.split(",")]
        rows = [shared_prefix(s, at) for s in seeds]
        hits, p99s = [h for h, _ in rows], [t for _, t in rows]
        label = "the rate alone" if weight == RATE_ONLY else f"at least {weight:g}"
        print(
            f"| {label} | {', '.join(f'{w:.2f}' for w in waves)} "
            f"| {statistics.mean(hits):.1%}; {min(hits):.1%}-{max(hits):.1%} "
            f"| {statistics.mean(p99s):.3f} s; {min(p99s):.3f}-{max(p99s):.3f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
