"""Shedding to a latency objective (issue 28): three classes over a load ramp of 0.5x to 1.5x
the fleet's capacity, with the router acting on predicted misses and without.

In the simulator (lab/extproc_lab/sim/priority.py), replica models of ``llama-8b-h100`` routed by
the default profile, latency models learned online as the server learns them. Requests arrive
open loop (Poisson), unique prompts (lognormal, mean 300 prompt / 100 output tokens), in three
classes by tenant, each with objectives (sent as ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``):

- ``premium`` (the highest class): ``on_miss: best_effort`` in every run: never refused;
- ``standard``: shed on a predicted miss (``on_miss: shed``) when shedding is on;
- ``batch``: shed too (``shed``), or held in the router's queue until a replica is predicted to
  meet it (``shed+queue``: ``on_miss: queue``, priority below the others, ``queueing.enabled``).

The fleet's capacity is measured first (the mix at four times a guess, every request routed,
requests finished per second). Each run then sends ``load`` x that. "met" is the share of a
class's requests that met both objectives, TTFT from arrival (the router's queue included) to
the first token and TPOT after it; a refused request counts as missed in "met (all)" and is left
out of "met (served)". A shed request is not retried. The classes that shed or queue are
admitted with ``--margins`` as their ``admit_margin`` (one run each; the config's default if not
given). Deterministic for a seed.

    .venv/bin/python benchmarks/objective_shedding.py [--replicas 2 --seconds 60 --loads 0.5,1,1.5 --margins 0,0.2]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass

from extproc.api import Config, QueueClass, QueueSettings
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import merge, unique_prompts
from extproc_lab.sim.priority import PriorityRun, PrioritySimulation
from extproc_lab.sim.workload import SimRequest, Workload
from extproc_lab.stats import percentile


@dataclass(frozen=True)
class ClassSpec:
    """One class of the mix: its share of requests and its objectives."""

    name: str
    share: float
    ttft_ms: float
    tpot_ms: float | None


# The classes that may be shed have tighter objectives than premium's: a class is shed on a miss
# of its own objectives, so theirs are the load at which shedding starts, below premium's limit.
CLASSES = (
    ClassSpec("premium", 0.2, 1000.0, 80.0),
    ClassSpec("standard", 0.5, 500.0, 50.0),
    ClassSpec("batch", 0.3, 500.0, 50.0),
)
LONG = 1e9  # limits nothing reaches: only on_miss refuses


def request_class(req: SimRequest) -> str:
    """The class is the tenant."""
    return req.tenant


def mix(rate: float, seconds: float, seed: int) -> Workload:
    """The three classes at ``rate`` requests per second in all, for ``seconds``."""
    parts = []
    for k, c in enumerate(CLASSES):
        qps = rate * c.share
        part = unique_prompts(
            max(1, round(qps * seconds)),
            seed=seed + k,
            qps=qps,
            mean_prompt_tokens=300,
            mean_output_tokens=100,
            tenant=c.name,
        )
        for r in part.requests:
            r.slo_class, r.slo_ttft_ms, r.slo_tpot_ms = c.name, c.ttft_ms, c.tpot_ms
        parts.append(part)
    return merge("premium+standard+batch", parts, {"rate": rate, "seconds": seconds, "seed": seed})


def settings(mode: str, margin: float = 0.0) -> QueueSettings:
    """The queueing section of a run: ``off`` (today: every class best effort), ``shed``,
    ``shed+queue``; ``margin``: the ``admit_margin`` of the classes that shed or queue."""
    best = QueueClass(priority=2, max_wait_s=LONG, max_queued=10**9)
    if mode == "off":
        return QueueSettings(default=best)
    shed = best.model_copy(update={"priority": 1, "on_miss": "shed", "admit_margin": margin})
    if mode == "shed":
        return QueueSettings(default=best, classes={"premium": best, "standard": shed, "batch": shed})
    queue = best.model_copy(update={"priority": 0, "on_miss": "queue", "max_wait_s": 60.0, "admit_margin": margin})
    return QueueSettings(
        enabled=True,
        kv_threshold=1.0,  # held for objectives only: never for saturation
        queue_threshold=10**9,
        default=best,
        classes={"premium": best, "standard": shed, "batch": queue},
    )


def simulate(workload: Workload, replicas: int, mode: str, margin: float = 0.0) -> PriorityRun:
    sim = PrioritySimulation(
        workload, get_profile("llama-8b-h100"), replicas, None, Config(queueing=settings(mode, margin)), request_class
    )
    return sim.run()


def capacity(replicas: int, guess: float, seconds: float, seed: int) -> float:
    """Requests per second the fleet finishes when it is given more than it can take."""
    run = simulate(mix(guess * 4, seconds, seed), replicas, "off")
    start = min(s.arrival for s in run.served)
    end = max(s.finish for s in run.served)
    return len(run.served) / (end - start)


@dataclass(frozen=True)
class ClassFigures:
    """One class in one run."""

    requests: int
    served: int
    met: int
    refused: dict[str, int]
    ttft_p99_s: float

    @property
    def met_all(self) -> float:
        return self.met / self.requests if self.requests else 0.0

    @property
    def met_served(self) -> float:
        return self.met / self.served if self.served else 0.0


def met(spec: ClassSpec, arrival: float, first: float, finish: float, tokens: int) -> bool:
    if (first - arrival) * 1000.0 > spec.ttft_ms:
        return False
    return spec.tpot_ms is None or tokens <= 1 or (finish - first) * 1000.0 / (tokens - 1) <= spec.tpot_ms


def figures(workload: Workload, run: PriorityRun) -> dict[str, ClassFigures]:
    out = {}
    for spec in CLASSES:
        served = [s for s in run.served if s.request_class == spec.name]
        total = sum(1 for r in workload.requests if r.tenant == spec.name)
        refused = Counter(why for i, why in run.refusals.items() if run.classes[i] == spec.name)
        ok = sum(met(spec, s.arrival, s.first_token, s.finish, s.output_tokens) for s in served)
        ttft = percentile([s.first_token - s.arrival for s in served], 0.99)
        out[spec.name] = ClassFigures(total, len(served), ok, dict(refused), ttft)
    return out


@dataclass(frozen=True)
class Row:
    """One run of the ramp."""

    load: float
    mode: str
    classes: dict[str, ClassFigures]
    span_s: float
    """First arrival to last answer."""


def refused(c: ClassFigures) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(c.refused.items())) or "0"


def table(rows: list[Row]) -> str:
    """The Markdown table."""
    lines = [
        "| load | run | premium met | premium TTFT p99 (s) | standard met (all / served) | standard refused "
        "| batch met (all / served) | batch refused | requests met per s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p, s, b = (row.classes[c.name] for c in CLASSES)
        lines.append(
            f"| {row.load:g}x | {row.mode} | {p.met_all:.1%} | {p.ttft_p99_s:.2f} "
            f"| {s.met_all:.1%} / {s.met_served:.1%} | {refused(s)} "
            f"| {b.met_all:.1%} / {b.met_served:.1%} | {refused(b)} | {(p.met + s.met + b.met) / row.span_s:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the ramp, print the table, write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--loads", default="0.5,0.75,1,1.25,1.5")
    ap.add_argument("--modes", default="off,shed,shed+queue")
    ap.add_argument("--guess", type=float, default=20.0, help="requests/s: the capacity run sends four times this")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--margins",
        default=f"{QueueClass().admit_margin:g}",
        help="admit_margin of the classes shed or queued, comma-separated: a run each (default: the config's)",
    )
    args = ap.parse_args(argv)
    started = time.monotonic()
    cap = capacity(args.replicas, args.guess, args.seconds, args.seed)
    print(f"capacity {cap:.2f} req/s", flush=True)
    rows = []
    margins = [float(m) for m in args.margins.split(",")]
    for load in (float(x) for x in args.loads.split(",")):
        workload = mix(load * cap, args.seconds, args.seed)
        for mode in args.modes.split(","):
            for margin in margins if mode != "off" else [0.0]:
                run = simulate(workload, args.replicas, mode, margin)
                start = min(r.arrival_s for r in workload.requests)
                label = f"{mode}, margin {margin:g}" if mode != "off" else mode
                rows.append(Row(load, label, figures(workload, run), max(s.finish for s in run.served) - start))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    print(f"{time.monotonic() - started:.0f} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
