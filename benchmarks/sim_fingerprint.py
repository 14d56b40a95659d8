"""Exact fingerprints of simulator runs, to show a refactor of the simulator or of a peer policy
changes no figure: every policy of ``extproc bench routing`` (at two KV-cache sizes), the dynamic
simulation (scale out and in, with and without pre-warming and rebalancing) and the priority
simulation (with and without the queue), each run's every outcome hashed.

    .venv/bin/python benchmarks/sim_fingerprint.py > before.json   # on the old commit
    .venv/bin/python benchmarks/sim_fingerprint.py > after.json    # on the new one
    diff before.json after.json

Small runs (a minute on one core); the hashes are meaningful only between two commits on one
machine and Python version.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import priority_queueing
import scaling

from extproc.api import Config, QueueSettings, with_overrides
from extproc_lab.bench.policies import KV_EVENTS, KV_EVENTS_DELAY_S, PEERS, policy_profile, scrape_interval
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.dynamic import DynamicSimulation
from extproc_lab.sim.generators import multi_turn
from extproc_lab.sim.simulator import SimRun, Simulation


def digest(obj: Any) -> str:
    """A short hash of ``repr(obj)`` (floats exactly)."""
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def sim_run(run: SimRun) -> tuple[Any, ...]:
    """Everything a run produced."""
    return (
        run.policy,
        run.replicas,
        [tuple(asdict(o).values()) for o in run.outcomes],
        run.busy_s,
        run.prefill_tokens,
        run.preemptions,
        run.window_s,
        run.requests_series,
        run.tokens_series,
        run.decisions,
        run.events,
    )


def main() -> int:
    out: dict[str, Any] = {}
    replica = get_profile("llama-8b-h100")
    small = replace(replica, num_gpu_blocks=3000)
    cfg = Config()
    workload = multi_turn(150, seed=3)
    for policy in ["extproc", *PEERS, KV_EVENTS]:
        for rp in (replica, small):
            sim = Simulation(
                workload,
                rp,
                4,
                lambda probe, p=policy, r=rp: policy_profile(p, probe, 7, r, cfg),
                policy=policy,
                config=cfg,
                scrape_interval_s=scrape_interval(policy),
                kv_events_delay_s=KV_EVENTS_DELAY_S if policy == KV_EVENTS else None,
            )
            out[f"sim/{policy}/{rp.num_gpu_blocks}"] = digest(sim_run(sim.run()))
    for mode in ("prewarm", "no-prewarm", "no-rebalance"):
        c = with_overrides(cfg, rebalance=scaling.MODES[mode])
        sim = DynamicSimulation(
            multi_turn(300, seed=5),
            replica,
            3,
            lambda probe, c=c: policy_profile("extproc", probe, 7, replica, c),
            policy=mode,
            config=c,
            changes=[(30.0, 5), (60.0, 2)],
        )
        d = sim.run_dynamic()
        changes = [(*astuple_change(x),) for x in d.changes]
        out[f"dyn/{mode}"] = digest(
            (sim_run(d.run), changes, d.prewarms_sent, d.prewarm_results, d.refused, d.session_keys, d.tenants)
        )
        out[f"dyn/{mode}/summary"] = [len(d.run.outcomes), d.prewarms_sent, [(x.at_s, x.moved) for x in d.changes]]
    mix = priority_queueing.mix(40.0, 20.0, 7)
    queued = QueueSettings(enabled=True, max_inflight_per_replica=8)
    for name, q in (("off", QueueSettings()), ("on", queued)):
        run = priority_queueing.simulate(mix, 2, q)
        out[f"prio/{name}"] = digest(([asdict(s) for s in run.served], run.refused, run.classes, run.max_waiting))
        out[f"prio/{name}/summary"] = [len(run.served), run.refused, run.max_waiting]
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


def astuple_change(change: Any) -> tuple[Any, ...]:
    """A change with its moved sessions in order (a frozenset's order varies between processes)."""
    return (
        change.at_s,
        change.replicas_before,
        change.replicas_after,
        change.joined,
        change.left,
        change.live_sessions,
        change.moved,
        sorted(change.moved_sessions),
    )


if __name__ == "__main__":
    raise SystemExit(main())
