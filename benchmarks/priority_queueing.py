"""Interactive plus batch traffic at 1.5x the fleet's capacity, with and without priority
queueing (issue 19).

In the simulator (lab/extproc_lab/sim/priority.py), replica models of ``llama-8b-h100`` routed by
the default profile. Interactive requests (tenant ``chat``: unique short prompts, lognormal, mean
300 prompt / 100 output tokens) and batch requests (tenants ``batch-a`` and ``batch-b``: mean
1,000 / 250) arrive open loop (Poisson) for ``--seconds``. The fleet's capacity is measured first:
the same mix at four times a guess, without queueing; capacity is requests finished per second
from the first arrival to the last answer. The experiment then sends the mix at ``--load`` times
that capacity:

- **without queueing**: every request goes to a replica at once and waits in its vLLM queue;
- **with queueing**: ``queueing: {enabled: true, max_inflight_per_replica: N}``; batch is
  priority 0, interactive (the default class) priority 1; limits are long enough that nothing is
  refused, so both runs serve the same requests.

Figures: interactive TTFT p99 (arrival to first token, the wait in the router's queue included)
and batch throughput (batch requests finished per second, first arrival to last batch answer).
Deterministic for a seed.

    .venv/bin/python benchmarks/priority_queueing.py [--out benchmarks/priority_queueing.md]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from extproc.api import Config, QueueClass, QueueSettings
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import merge, unique_prompts
from extproc_lab.sim.priority import PriorityRun, PrioritySimulation
from extproc_lab.sim.workload import SimRequest, Workload
from extproc_lab.stats import percentile

INTERACTIVE_SHARE = 0.5  # of requests
NO_LIMIT = QueueClass(priority=1, max_wait_s=1e9, max_queued=10**9)


def request_class(req: SimRequest) -> str:
    """Batch tenants' requests are batch, the rest interactive (the default class)."""
    return "batch" if req.tenant.startswith("batch") else "default"


def mix(rate: float, seconds: float, seed: int) -> Workload:
    """Interactive and batch requests at ``rate`` requests per second in all, for ``seconds``."""
    chat_rate = rate * INTERACTIVE_SHARE
    batch_rate = rate * (1 - INTERACTIVE_SHARE) / 2
    parts = [
        unique_prompts(
            max(1, round(chat_rate * seconds)),
            seed=seed,
            qps=chat_rate,
            mean_prompt_tokens=300,
            mean_output_tokens=100,
            tenant="chat",
        )
    ]
    for k, tenant in enumerate(("batch-a", "batch-b")):
        count = max(1, round(batch_rate * seconds))
        parts.append(unique_prompts(count, seed=seed + 1 + k, qps=batch_rate, tenant=tenant))
    return merge("interactive+batch", parts, {"rate": rate, "seconds": seconds, "seed": seed})


def simulate(workload: Workload, replicas: int, queueing: QueueSettings) -> PriorityRun:
    config = Config(queueing=queueing)
    sim = PrioritySimulation(workload, get_profile("llama-8b-h100"), replicas, None, config, request_class)
    return sim.run()


def capacity(replicas: int, guess: float, seconds: float, seed: int) -> float:
    """Requests per second the fleet finishes when it is given more than it can take."""
    run = simulate(mix(guess * 4, seconds, seed), replicas, QueueSettings())
    start = min(s.arrival for s in run.served)
    end = max(s.finish for s in run.served)
    return len(run.served) / (end - start)


@dataclass(frozen=True)
class Figures:
    """One run's figures."""

    name: str
    interactive: int
    interactive_ttft_p50_s: float
    interactive_ttft_p99_s: float
    batch: int
    batch_per_s: float
    batch_tokens_per_s: float
    batch_ttft_p99_s: float
    refused: int
    max_waiting: int


def figures(name: str, run: PriorityRun) -> Figures:
    chat = [s for s in run.served if s.request_class != "batch"]
    batch = [s for s in run.served if s.request_class == "batch"]
    start = min(s.arrival for s in run.served)
    span = max(s.finish for s in batch) - start
    ttft = [s.first_token - s.arrival for s in chat]
    return Figures(
        name,
        len(chat),
        percentile(ttft, 0.5),
        percentile(ttft, 0.99),
        len(batch),
        len(batch) / span,
        sum(s.output_tokens for s in batch) / span,
        percentile([s.first_token - s.arrival for s in batch], 0.99),
        sum(run.refused.values()),
        run.max_waiting,
    )


def experiment(
    *, replicas: int, seconds: float, load: float, max_inflight: list[int], seed: int, guess: float
) -> tuple[list[Figures], float]:
    """Capacity, then the mix at ``load`` x capacity without queueing and with it, for each
    ``max_inflight_per_replica``."""
    cap = capacity(replicas, guess, seconds, seed)
    workload = mix(load * cap, seconds, seed)
    runs = [figures("without queueing", simulate(workload, replicas, QueueSettings()))]
    for n in max_inflight:
        queued = QueueSettings(
            enabled=True,
            max_inflight_per_replica=n,
            default=NO_LIMIT,
            classes={"batch": NO_LIMIT.model_copy(update={"priority": 0})},
        )
        runs.append(figures(f"with queueing, max_inflight_per_replica {n}", simulate(workload, replicas, queued)))
    return runs, cap


def table(runs: list[Figures]) -> str:
    """The Markdown table."""
    lines = [
        "| run | interactive | interactive TTFT p50 (ms) | interactive TTFT p99 (ms) | batch | batch req/s "
        "| batch output tok/s | batch TTFT p99 (s) | refused | most held at once |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in runs:
        lines.append(
            f"| {f.name} | {f.interactive} | {f.interactive_ttft_p50_s * 1000:.0f} "
            f"| {f.interactive_ttft_p99_s * 1000:.0f} "
            f"| {f.batch} | {f.batch_per_s:.2f} | {f.batch_tokens_per_s:.0f} | {f.batch_ttft_p99_s:.1f} "
            f"| {f.refused} | {f.max_waiting} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument(
        "--max-inflight", default="128,256,512", help="max_inflight_per_replica values, one queued run each"
    )
    ap.add_argument("--guess", type=float, default=20.0, help="requests/s: the capacity run sends four times this")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/priority_queueing.md")
    args = ap.parse_args(argv)
    started = time.monotonic()
    runs, cap = experiment(
        replicas=args.replicas,
        seconds=args.seconds,
        load=args.load,
        max_inflight=[int(n) for n in args.max_inflight.split(",")],
        seed=args.seed,
        guess=args.guess,
    )
    text = table(runs)
    print(f"capacity {cap:.2f} req/s")
    print(text)
    without = runs[0]
    verdicts = []
    for queued in runs[1:]:
        ttft_ratio = queued.interactive_ttft_p99_s / without.interactive_ttft_p99_s
        batch_ratio = queued.batch_per_s / without.batch_per_s
        ttft_met, batch_met = ttft_ratio <= 1 / 3, abs(batch_ratio - 1) <= 0.10
        verdicts.append(
            f"| {queued.name} | {ttft_ratio:.3f} | {'yes' if ttft_met else 'no'} | {batch_ratio:.3f} "
            f"({batch_ratio - 1:+.1%}) | {'yes' if batch_met else 'no'} |"
        )
    verdict = "\n".join(verdicts)
    print(verdict)
    command = (
        f"    .venv/bin/python benchmarks/priority_queueing.py --replicas {args.replicas} --seconds {args.seconds:g} "
        f"--load {args.load:g} --max-inflight {args.max_inflight} --guess {args.guess:g} --seed {args.seed}"
    )
    report = f"""# Priority queueing: interactive plus batch at {args.load:g}x capacity

Issue 19, last bullet. Generated by `benchmarks/priority_queueing.py` ({time.monotonic() - started:.0f} s wall):

{command}

Simulator (`lab/extproc_lab/sim/priority.py`), {args.replicas} `llama-8b-h100` replica models, the
default routing profile. Half the requests are interactive (tenant `chat`, unique prompts of mean
300 prompt / 100 output tokens), half batch (tenants `batch-a` and `batch-b`, mean 1,000 / 250),
Poisson arrivals for {args.seconds:g} s. Measured capacity of the fleet for this mix: {cap:.2f} requests/s
(the mix at four times {args.guess:g} req/s without queueing, requests finished per second); the runs
send {args.load:g}x that, {args.load * cap:.2f} requests/s.

- **without queueing**: every request goes to a replica at once (its vLLM queue holds it);
- **with queueing**: `queueing: {{enabled: true, max_inflight_per_replica: N}}` for N in
  {args.max_inflight}, batch priority 0 below interactive 1, limits long enough that nothing is refused.

{text}

TTFT is arrival to first token, the wait in the router's queue included. Batch throughput is batch
requests finished per second from the first arrival to the last batch answer.

Targets (issue 19): interactive TTFT p99 with queueing at most a third of without; batch
throughput within 10% of without.

| run | interactive TTFT p99, with / without | at most 1/3 | batch throughput, with / without | within 10% |
|---|---|---|---|---|
{verdict}
"""
    with open(args.out, "w") as fh:
        fh.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
