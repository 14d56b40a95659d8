"""Prefill/decode disaggregation against aggregated routing, at equal replica counts.

In the simulator (lab/extproc_lab/sim/disagg.py), on the ``llama-8b-h100`` profile (KV transfer
0.1 ms a block): 8 aggregated replicas routed by our router (the real Router with its own
estimates, as ``extproc bench routing`` runs it) and by the router's decision on the replicas'
true state; 2P+6D and 3P+5D with the router's decision (``extproc.api.decide``, the
code the server runs: the decode replica by the profile, then ``choose_prefill``), with the
price profile (``extproc.routing.price``), and with the peers' (every request disaggregated,
least loaded decode; prefill round robin as vLLM's toy proxy, random, or least loaded). Then the
threshold, swept on 2P+6D; a workload of short unrelated prompts, where a prefill hop buys
nothing; and the Mooncake conversation trace (long prompts). Deterministic.

    .venv/bin/python benchmarks/disaggregation.py [--conversations 1500] [--short 6000] [--mooncake 2000]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.api import PRICE_PROFILE, Config, PairSettings
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import ReplicaProfile, get_profile
from extproc_lab.sim.disagg import DisaggSimulation, PairPolicy, fleet, ours, peer
from extproc_lab.sim.generators import multi_turn, unique_prompts
from extproc_lab.sim.simulator import Simulation
from extproc_lab.sim.traces import load_mooncake, mooncake_workload, trace_path
from extproc_lab.sim.workload import Workload

NO_HOP = PairSettings(threshold_tokens=1 << 40)
"""A threshold no prompt reaches: every request aggregated."""
OURS = f"ours (router's decision, threshold {PairSettings().threshold_tokens})"
PRICE = "ours, price profile"


@dataclass(frozen=True)
class Row:
    """One run's figures, seconds (inter-token latency in milliseconds)."""

    fleet: str
    policy: str
    requests: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50_ms: float
    itl_p90_ms: float
    e2e_p50: float
    e2e_p90: float
    disaggregated: float
    blocks_per_hop: float


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def row(
    fleet_name: str,
    policy: str,
    ttft: list[float],
    itl: list[float],
    e2e: list[float],
    hops: int = 0,
    blocks: int = 0,
) -> Row:
    """Figures from per-request latencies."""
    n = len(ttft)
    return Row(
        fleet_name,
        policy,
        n,
        pct(ttft, 0.5),
        pct(ttft, 0.9),
        pct(ttft, 0.99),
        1000 * pct(itl, 0.5),
        1000 * pct(itl, 0.9),
        pct(e2e, 0.5),
        pct(e2e, 0.9),
        hops / n if n else 0.0,
        blocks / hops if hops else 0.0,
    )


def router_row(workload: Workload, profile: ReplicaProfile, replicas: int) -> Row:
    """Our router, aggregated (the real Router on the simulator's loop)."""
    cfg = Config()
    sim = Simulation(
        workload,
        profile,
        replicas,
        lambda probe: policy_profile("extproc", probe, 7, profile, cfg),
        policy="extproc",
        config=cfg,
    )
    out = sim.run().outcomes
    ttft = [o.first_token - o.arrival for o in out]
    itl = [(o.finish - o.first_token) / (o.output_tokens - 1) for o in out if o.output_tokens > 1]
    return row(f"{replicas} aggregated", "extproc router", ttft, itl, [o.finish - o.arrival for o in out])


def pd_row(
    workload: Workload, profile: ReplicaProfile, fleet_name: str, roles: list, name: str, policy: PairPolicy
) -> Row:
    """A pair policy on a fleet of ``roles``."""
    out = DisaggSimulation(workload, profile, roles, policy).run().outcomes
    hopped = [o for o in out if o.prefill is not None]
    return row(
        fleet_name,
        name,
        [o.ttft for o in out],
        [x for o in out if (x := o.itl) is not None],
        [o.e2e for o in out],
        len(hopped),
        sum(o.transfer_blocks for o in hopped),
    )


FLEETS = {"2P+6D": (2, 6), "3P+5D": (3, 5)}
PEERS: dict[str, Callable[[], PairPolicy]] = {
    "peer: round-robin prefill (vLLM toy proxy)": lambda: peer("round_robin"),
    "peer: random prefill": lambda: peer("random"),
    "peer: least-loaded prefill": lambda: peer("least_loaded"),
}
THRESHOLDS = (0, 128, 256, 512, 1024, 4096)


def table(rows: Sequence[Row]) -> str:
    """A markdown table of ``rows``."""
    head = (
        "| fleet | policy | requests | TTFT p50 | p90 | p99 | ITL p50 | p90 | e2e p50 | p90 "
        "| disaggregated | blocks/hop |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.fleet} | {r.policy} | {r.requests} | {r.ttft_p50:.3f} s | {r.ttft_p90:.3f} s | {r.ttft_p99:.3f} s "
        f"| {r.itl_p50_ms:.1f} ms | {r.itl_p90_ms:.1f} ms | {r.e2e_p50:.2f} s | {r.e2e_p90:.2f} s "
        f"| {100 * r.disaggregated:.0f}% | {r.blocks_per_hop:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def compare(workload: Workload, profile: ReplicaProfile, note: Callable[[str], None]) -> list[Row]:
    """Aggregated against P/D fleets with our pair choice and the peers'."""
    rows = [router_row(workload, profile, 8)]
    note("router")
    rows.append(
        pd_row(workload, profile, "8 aggregated", fleet(0, 0, 8), "router's decision, true state", ours(NO_HOP))
    )
    for fleet_name, (p, d) in FLEETS.items():
        rows.append(pd_row(workload, profile, fleet_name, fleet(p, d), OURS, ours()))
        rows.append(pd_row(workload, profile, fleet_name, fleet(p, d), PRICE, ours(profile=PRICE_PROFILE)))
        for name, make in PEERS.items():
            rows.append(pd_row(workload, profile, fleet_name, fleet(p, d), name, make()))
        note(fleet_name)
    return rows


def sweep(workload: Workload, profile: ReplicaProfile) -> list[Row]:
    """The router's decision on 2P+6D at each threshold."""
    return [
        pd_row(workload, profile, "2P+6D", fleet(2, 6), f"ours, threshold {t}", ours(PairSettings(threshold_tokens=t)))
        for t in THRESHOLDS
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1500)
    parser.add_argument("--short", type=int, default=6000, help="requests of the short-prompt workload")
    parser.add_argument("--mooncake", type=int, default=2000, help="requests of the Mooncake trace (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    profile = get_profile("llama-8b-h100")
    started = time.monotonic()

    def note(what: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {what}", file=sys.stderr)

    chat = multi_turn(args.conversations, seed=7)
    main_rows = compare(chat, profile, note)
    sweep_rows = sweep(chat, profile)
    note("sweep")
    short = unique_prompts(args.short, seed=7, qps=40.0, mean_prompt_tokens=150, mean_output_tokens=250)
    short_rows = compare(short, profile, note)
    mooncake_text = ""
    if args.mooncake:
        trace = mooncake_workload(load_mooncake(trace_path("mooncake-conversation"), args.mooncake), "mooncake")
        mean_trace = statistics.fmean(r.prompt_tokens for r in trace.requests)
        mooncake_text = (
            f"\nMooncake conversation trace (first {len(trace)} requests at the trace's rate, mean prompt "
            f"{mean_trace:.0f} tokens, no sessions):\n\n" + table(compare(trace, profile, note))
        )
    mean_prompt = statistics.fmean(r.prompt_tokens for r in chat.requests)
    text = (
        f"Multi-turn chat ({args.conversations} conversations, {len(chat)} requests, mean prompt "
        f"{mean_prompt:.0f} tokens), llama-8b-h100, "
        f"KV transfer {profile.kv_transfer_s_per_block * 1e3:.1f} ms/block:\n\n"
        + table(main_rows)
        + "\nThe router's decision on 2P+6D by threshold (tokens the decode replica lacks below which no hop is"
        " made):\n\n"
        + table(sweep_rows)
        + f"\nShort unrelated prompts ({args.short} requests at 40/s, mean prompt 150 tokens, mean output 250):\n\n"
        + table(short_rows)
        + mooncake_text
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    note("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
