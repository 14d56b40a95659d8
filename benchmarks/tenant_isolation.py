"""A noisy tenant at ten times its quota next to a steady tenant (issue 8).

In the simulator (lab/extproc_lab/sim/dynamic.py): the steady tenant (multi-turn chat) alone; then with a
noisy tenant (unique batch prompts, open loop) sending at ten times its concurrency quota, with
isolation (``tenants: {noisy: {max_concurrent: Q, over_quota: reject}}``; refused requests are
dropped and counted); then the same without isolation. The noisy rate is ten times the rate at
which Q requests in flight would be sustained (Little's law with the noisy requests' mean latency
measured on the idle fleet). Deterministic for a seed.

    .venv/bin/python benchmarks/tenant_isolation.py [--out benchmarks/tenant_isolation.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from extproc.api import Config, TenantPolicy, TenantSettings
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.dynamic import DynamicRun, DynamicSimulation
from extproc_lab.sim.generators import merge, multi_turn, unique_prompts
from extproc_lab.sim.workload import Workload
from extproc_lab.stats import percentile


@dataclass(frozen=True)
class Case:
    """One run's figures for the steady tenant (and what happened to the noisy one)."""

    name: str
    steady_requests: int
    steady_ttft_p99_s: float
    noisy_sent: int
    noisy_served: int
    noisy_refused: int


def _run(workload: Workload, replicas: int, seed: int, tenants: TenantSettings | None) -> DynamicRun:
    replica = get_profile("llama-8b-h100")
    config = Config() if tenants is None else Config(tenants=tenants)
    sim = DynamicSimulation(
        workload,
        replica,
        replicas,
        lambda probe: policy_profile("extproc", probe, seed, replica, config),
        config=config,
    )
    return sim.run_dynamic()


def _case(name: str, d: DynamicRun) -> Case:
    steady = [o.first_token - o.arrival for o in d.run.outcomes if d.tenants.get(o.index) == "steady"]
    noisy_sent = sum(1 for t in d.tenants.values() if t == "noisy")
    noisy_served = sum(1 for o in d.run.outcomes if d.tenants.get(o.index) == "noisy")
    return Case(name, len(steady), percentile(steady, 0.99), noisy_sent, noisy_served, noisy_sent - noisy_served)


def noisy_latency(replicas: int, seed: int, count: int) -> float:
    """Mean latency (arrival to last token) of the noisy tenant's requests on an idle fleet."""
    probe = unique_prompts(count, seed=seed + 1, qps=0.5, tenant="noisy")
    d = _run(probe, replicas, seed, None)
    return sum(o.finish - o.arrival for o in d.run.outcomes) / len(d.run.outcomes)


def experiment(
    *, replicas: int = 4, conversations: int = 400, conv_per_s: float = 2.0, quota: int = 8, seed: int = 7
) -> tuple[list[Case], dict[str, float]]:
    """The three runs: steady alone, with the noisy tenant isolated, and without isolation."""
    steady = multi_turn(conversations, seed=seed, conversations_per_s=conv_per_s, tenant="steady")
    span = max(r.arrival_s for r in steady.requests if r.after < 0)
    latency = noisy_latency(replicas, seed, 20)
    rate = 10 * quota / latency
    noisy = unique_prompts(max(1, int(rate * span)), seed=seed + 1, qps=rate, tenant="noisy")
    mixed = merge("steady+noisy", [steady, noisy])
    isolation = TenantSettings(definitions={"noisy": TenantPolicy(max_concurrent=quota, over_quota="reject")})
    cases = [
        _case("steady alone", _run(steady, replicas, seed, None)),
        _case("steady + noisy, isolation", _run(mixed, replicas, seed, isolation)),
        _case("steady + noisy, no isolation", _run(mixed, replicas, seed, None)),
    ]
    return cases, {"noisy_latency_s": latency, "noisy_rate": rate, "span_s": span}


def table(cases: list[Case]) -> str:
    """The Markdown table."""
    alone = cases[0].steady_ttft_p99_s
    lines = [
        "| run | steady requests | steady TTFT p99 (ms) | vs alone | within 10% | noisy sent | noisy served "
        "| noisy refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        ratio = c.steady_ttft_p99_s / alone if alone else 0.0
        lines.append(
            f"| {c.name} | {c.steady_requests} | {c.steady_ttft_p99_s * 1000:.0f} | {ratio - 1:+.1%} "
            f"| {'yes' if ratio <= 1.10 else 'no'} | {c.noisy_sent} | {c.noisy_served} | {c.noisy_refused} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the three cases, print the table, write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--conversations-per-s", type=float, default=2.0)
    ap.add_argument("--quota", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/tenant_isolation.md")
    args = ap.parse_args(argv)
    started = time.monotonic()
    cases, info = experiment(
        replicas=args.replicas,
        conversations=args.conversations,
        conv_per_s=args.conversations_per_s,
        quota=args.quota,
        seed=args.seed,
    )
    text = table(cases)
    print(text)
    print(info)
    command = (
        f"    .venv/bin/python benchmarks/tenant_isolation.py --replicas {args.replicas} "
        f"--conversations {args.conversations} --conversations-per-s {args.conversations_per_s:g} "
        f"--quota {args.quota} --seed {args.seed}"
    )
    report = f"""# Tenant isolation: a noisy tenant at ten times its quota next to a steady tenant

Issue 8, last bullet. Generated by `benchmarks/tenant_isolation.py` ({time.monotonic() - started:.0f} s wall):

{command}

Simulator (`lab/extproc_lab/sim/dynamic.py`), {args.replicas} `llama-8b-h100` replica models, the default
`extproc` profile. The steady tenant is multi-turn chat (`multi_turn({args.conversations},
conversations_per_s={args.conversations_per_s:g}, tenant="steady")`, closed loop). The noisy tenant
sends unique batch prompts (mean 1,000 prompt / 250 output tokens, Poisson) at
{info["noisy_rate"]:.2f} req/s over the steady tenant's {info["span_s"]:.0f} s of conversation
starts: ten times the rate that keeps its quota of {args.quota} requests in flight
(10 x {args.quota} / {info["noisy_latency_s"]:.2f} s mean latency on an idle fleet).

- **isolation**: `tenants: {{definitions: {{noisy: {{max_concurrent: {args.quota}, over_quota:
  reject}}}}}}` — the router refuses the noisy tenant's requests over quota (Decision reason
  `quota`, a 429 in the server); the simulator drops and counts them;
- **no isolation**: no tenant policies.

{text}

TTFT p99 is over all the steady tenant's requests (arrival to first token).
"""
    Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
