"""How far the router's latency models are off on the simulator's replicas: the median relative
error of each replica's TTFT and TPOT predictions (made before each observation, over its last
128 once warm) after a run of our default profile.

    .venv/bin/python benchmarks/latency_model_error.py [--workload multi-turn] [--rate 1.0]
        [--limit 3000] [--slow-profile llama-8b-a100]

A few thousand requests (tens of seconds on one core).
"""

from __future__ import annotations

import argparse
import statistics

from extproc_lab.bench.policies import OURS, policy_profile
from extproc_lab.bench.routing import BenchSetup
from extproc_lab.bench.workloads import WORKLOADS, WorkloadSpec
from extproc_lab.sim.simulator import Simulation


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="multi-turn")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--limit", type=int, default=3000)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--slow-profile", default=None)
    args = p.parse_args()
    setup = BenchSetup(
        WorkloadSpec(args.workload, rate=args.rate, limit=args.limit),
        args.replicas,
        slow_profile=args.slow_profile,
        slow_replicas=args.replicas // 2 if args.slow_profile else 0,
    )
    replica, config = setup.replica_profile(), setup.config()
    config = config.model_copy(update={"health": config.health.model_copy(update={"latency_models": "always"})})
    sim = Simulation(
        setup.workload.build(),
        replica,
        setup.replicas,
        lambda probe: policy_profile(OURS, probe, setup.seed, replica, config),
        config=config,
        slower=setup.slower(),
    )
    sim.run()
    fits = sim.driver.latency_fits()
    print("| replica | profile | TTFT samples | TTFT error p50 | TPOT samples | TPOT error p50 |")
    print("|---|---|---|---|---|---|")
    for i, name in enumerate(sim.names):
        f = fits[name]
        print(
            f"| {name} | {sim.models[i].profile.name} | {f.ttft_samples} | {f.ttft_error:.1%} | "
            f"{f.tpot_samples} | {f.tpot_error:.1%} |"
        )
    ttft = statistics.median(f.ttft_error for f in fits.values() if f.ttft_error is not None)
    tpot = statistics.median(f.tpot_error for f in fits.values() if f.tpot_error is not None)
    print(f"\nmedian over replicas: TTFT {ttft:.1%}, TPOT {tpot:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
