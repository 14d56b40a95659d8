"""Exact fingerprints of simulator runs, to show a refactor of the router, the simulator or a peer
policy changes no figure: every policy of ``extproc bench routing`` (at two KV-cache sizes), the
dynamic simulation (scale out and in, with and without pre-warming and rebalancing) and the
priority simulation (with and without the queue), each run's every outcome hashed.

The fingerprints are stored in ``benchmarks/sim_fingerprint.json`` and compared by
``tests/project/test_fingerprints.py``:

    make fingerprints                                        # regenerate the stored file
    make fingerprints-check                                  # compare every run with it
    .venv/bin/python benchmarks/sim_fingerprint.py --check benchmarks/sim_fingerprint.json --only 'dyn/*'
    .venv/bin/python benchmarks/sim_fingerprint.py > now.json  # print them

Small runs (20 s on one idle core of the CI machine). The hashes are of ``repr`` of every float
a run produced, so they hold on one platform only: floats' repr is exact and the same everywhere,
but the floats themselves pass through the C library's ``exp``/``log``/``pow``, which may differ
in the last bit between C libraries or CPUs. They are committed as made on x86_64 Debian with the
Python of CI; a regeneration is a change of behaviour unless the commit says why it is not.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import priority_queueing
import scaling

from extproc.api import Config, QueueSettings, with_overrides
from extproc_lab.bench.policies import KV_EVENTS, KV_EVENTS_DELAY_S, PEERS, policy_profile, scrape_interval
from extproc_lab.replica.timing import ReplicaProfile, get_profile
from extproc_lab.sim.dynamic import DynamicSimulation
from extproc_lab.sim.generators import multi_turn
from extproc_lab.sim.simulator import SimRun, Simulation

Entries = dict[str, Any]


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


def runs() -> Iterator[tuple[str, Callable[[], Entries]]]:
    """Every run by name, each a function making its entries (its hash, and for some a readable
    summary beside it): a run is made only when selected."""
    replica = get_profile("llama-8b-h100")
    small = replace(replica, num_gpu_blocks=3000)
    cfg = Config()
    for policy in ["extproc", *PEERS, KV_EVENTS]:
        for rp in (replica, small):
            name = f"sim/{policy}/{rp.num_gpu_blocks}"
            yield name, lambda name=name, policy=policy, rp=rp: {name: _routing(policy, rp, cfg)}
    for mode in ("prewarm", "no-prewarm", "no-rebalance"):
        name = f"dyn/{mode}"
        yield name, lambda name=name, mode=mode: _dynamic(name, mode, replica, cfg)
    for name, q in (
        ("prio/off", QueueSettings()),
        ("prio/on", QueueSettings(enabled=True, max_inflight_per_replica=8)),
    ):
        yield name, lambda name=name, q=q: _priority(name, q)


def _routing(policy: str, rp: ReplicaProfile, cfg: Config) -> str:
    sim = Simulation(
        multi_turn(150, seed=3),
        rp,
        4,
        lambda probe: policy_profile(policy, probe, 7, rp, cfg),
        policy=policy,
        config=cfg,
        scrape_interval_s=scrape_interval(policy),
        kv_events_delay_s=KV_EVENTS_DELAY_S if policy == KV_EVENTS else None,
    )
    return digest(sim_run(sim.run()))


def _dynamic(name: str, mode: str, replica: ReplicaProfile, cfg: Config) -> Entries:
    c = with_overrides(cfg, rebalance=scaling.MODES[mode])
    sim = DynamicSimulation(
        multi_turn(300, seed=5),
        replica,
        3,
        lambda probe: policy_profile("extproc", probe, 7, replica, c),
        policy=mode,
        config=c,
        changes=[(30.0, 5), (60.0, 2)],
    )
    d = sim.run_dynamic()
    changes = [(*astuple_change(x),) for x in d.changes]
    return {
        name: digest(
            (sim_run(d.run), changes, d.prewarms_sent, d.prewarm_results, d.refused, d.session_keys, d.tenants)
        ),
        f"{name}/summary": [len(d.run.outcomes), d.prewarms_sent, [[x.at_s, x.moved] for x in d.changes]],
    }


def _priority(name: str, q: QueueSettings) -> Entries:
    run = priority_queueing.simulate(priority_queueing.mix(40.0, 20.0, 7), 2, q)
    return {
        name: digest(([asdict(s) for s in run.served], run.refused, run.classes, run.max_waiting)),
        f"{name}/summary": [len(run.served), run.refused, run.max_waiting],
    }


def fingerprints(only: list[str] | None = None) -> Entries:
    """The entries of every run whose name matches one of the globs ``only`` (all without)."""
    out: Entries = {}
    for name, make in runs():
        if only is None or any(fnmatch.fnmatchcase(name, pattern) for pattern in only):
            out.update(make())
    return out


def differences(stored: Entries, now: Entries, only: list[str] | None = None) -> list[str]:
    """What differs between the stored entries and ``now``'s, one line an entry; with ``only``,
    stored entries of runs not selected are not compared."""
    selected = {name for name, _ in runs() if only is None or any(fnmatch.fnmatchcase(name, p) for p in only)}

    def compared(key: str) -> bool:
        return key in selected or key.removesuffix("/summary") in selected

    now = json.loads(json.dumps(now))  # as it would be stored: tuples become lists
    lines = []
    for key in sorted(k for k in stored.keys() | now.keys() if compared(k)):
        if key not in now:
            lines.append(f"{key}: stored, no longer made")
        elif key not in stored:
            lines.append(f"{key}: new, not stored (now {json.dumps(now[key])})")
        elif stored[key] != now[key]:
            lines.append(f"{key}: stored {json.dumps(stored[key])}, now {json.dumps(now[key])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--only", nargs="+", metavar="GLOB", help="only the runs whose name matches (e.g. 'sim/*')")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true", help="print the runs' names, one a line, and run none")
    action.add_argument("--write", type=Path, metavar="FILE", help="write the fingerprints to FILE")
    action.add_argument(
        "--check", type=Path, metavar="FILE", help="compare with FILE: exit 1, naming each entry that differs"
    )
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(name for name, _ in runs()))
        return 0
    names = [name for name, _ in runs()]
    unmatched = [p for p in args.only or () if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        parser.error(f"--only {' '.join(unmatched)} matches no run (--list names them)")
    if args.check is not None:
        stored = json.loads(args.check.read_text(encoding="utf-8"))
        changed = differences(stored, fingerprints(args.only), args.only)
        if changed:
            print(f"{len(changed)} simulator fingerprint(s) differ from {args.check}:", file=sys.stderr)
            for line in changed:
                print(f"  {line}", file=sys.stderr)
            print(
                "If the change is meant, regenerate with `make fingerprints` and say why in the commit.",
                file=sys.stderr,
            )
            return 1
        print(f"the fingerprints match {args.check}", file=sys.stderr)
        return 0
    if args.write is not None and args.only is not None:
        parser.error("--write stores every run: no --only")
    text = json.dumps(fingerprints(args.only), indent=1) + "\n"
    if args.write is not None:
        args.write.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
