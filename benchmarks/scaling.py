"""Scale-out 8 -> 10 and scale-in 10 -> 8 in the middle of the multi-turn workload (issue 4).

In the simulator (lab/extproc_lab/sim/dynamic.py): the router's own ``set_replicas`` at each change, the
simulator gaining (and draining) replica models, pre-warms sent by the real prewarmer (token
bucket, queue) as prefill-only requests (max_tokens 1) to the target replica model. Three modes:
pre-warming on (the default rebalance settings), pre-warming off (sessions still move), and
rebalancing off (sessions are not moved by the rebalancer). Deterministic for a seed.

    .venv/bin/python benchmarks/scaling.py [--conversations 3600] [--out benchmarks/scaling.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from extproc.api import Config, PrewarmSettings, RebalanceSettings
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.dynamic import DynamicRun, DynamicSimulation, WindowFigures, window_figures
from extproc_lab.sim.generators import multi_turn

MODES: dict[str, RebalanceSettings] = {
    "prewarm": RebalanceSettings(move_on_join=True, prewarm=PrewarmSettings(enabled=True)),
    "no-prewarm": RebalanceSettings(move_on_join=True, prewarm=PrewarmSettings(enabled=False)),
    "default": RebalanceSettings(),
    "no-rebalance": RebalanceSettings(enabled=False),
}


@dataclass(frozen=True)
class ChangeRow:
    """One mode's figures around one membership change."""

    mode: str
    change: str
    at_s: float
    live: int
    moved: int
    moved_share: float
    next_turns: int
    changed_share: float
    changed_hit: float
    before: WindowFigures
    after: WindowFigures


def next_turn_figures(d: DynamicRun, at: float, until: float) -> tuple[int, float, float]:
    """Sessions whose first turn after ``at`` (and before ``until``) follows a turn before it:
    how many, the share that landed on another replica, and those turns' token hit ratio."""
    seen: set[str] = set()
    changed = total = prompt = cached = 0
    for o in sorted(d.run.outcomes, key=lambda o: o.arrival):
        key = d.session_keys.get(o.index)
        if key is None or o.arrival < at or o.arrival >= until or key in seen or o.stayed is None:
            continue
        seen.add(key)
        total += 1
        if not o.stayed:
            changed += 1
            prompt += o.prompt_tokens
            cached += o.cached_tokens
    return total, changed / total if total else 0.0, cached / prompt if prompt else 0.0


def run_mode(
    mode: str, conversations: int, seed: int, out_at: float, in_at: float, window: float
) -> tuple[list[ChangeRow], DynamicRun]:
    """One mode over the workload, and its rows."""
    workload = multi_turn(conversations, seed=seed)
    replica = get_profile("llama-8b-h100")
    config = Config(rebalance=MODES[mode])
    sim = DynamicSimulation(
        workload,
        replica,
        8,
        lambda probe: policy_profile("extproc", probe, seed, replica, config),
        policy=mode,
        config=config,
        changes=[(out_at, 10), (in_at, 8)],
    )
    d = sim.run_dynamic()
    rows = []
    bounds = [c.at_s for c in d.changes] + [float("inf")]
    for c, nxt in zip(d.changes, bounds[1:], strict=True):
        total, changed, changed_hit = next_turn_figures(d, c.at_s, min(nxt, c.at_s + window))
        label = f"{c.replicas_before} -> {c.replicas_after}"
        rows.append(
            ChangeRow(
                mode,
                label,
                c.at_s,
                c.live_sessions,
                c.moved,
                c.moved_share,
                total,
                changed,
                changed_hit,
                window_figures(d.run.outcomes, c.at_s - window, c.at_s),
                window_figures(d.run.outcomes, c.at_s, c.at_s + window),
            )
        )
    return rows, d


def table(rows: list[ChangeRow], window: float) -> str:
    """The Markdown table."""
    w = int(window)
    head = (
        f"| mode | change | at (s) | live sessions | moved | moved share | next turns | on another replica "
        f"| their hit ratio | hit ratio {w}s before | hit ratio {w}s after | TTFT p99 before (ms) "
        f"| TTFT p99 after (ms) |\n|" + "---|" * 13
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.change} | {r.at_s:.0f} | {r.live} | {r.moved} | {r.moved_share:.1%} | {r.next_turns} "
            f"| {r.changed_share:.1%} | {r.changed_hit:.3f} | {r.before.hit_ratio:.3f} | {r.after.hit_ratio:.3f} "
            f"| {r.before.ttft_p99_s * 1000:.0f} | {r.after.ttft_p99_s * 1000:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every mode, print the table, write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=3600)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scale-out-at", type=float, default=120.0)
    ap.add_argument("--scale-in-at", type=float, default=240.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--out", default="benchmarks/scaling.md")
    args = ap.parse_args(argv)
    rows: list[ChangeRow] = []
    extra = []
    started = time.monotonic()
    for mode in MODES:
        t = time.monotonic()
        mode_rows, d = run_mode(mode, args.conversations, args.seed, args.scale_out_at, args.scale_in_at, args.window)
        rows.extend(mode_rows)
        extra.append(
            f"- {mode}: {len(d.run.outcomes)} requests, pre-warms sent {d.prewarms_sent} "
            f"(outcomes {d.prewarm_results or {}}), simulated in {time.monotonic() - t:.1f} s"
        )
    text = table(rows, args.window)
    print(text)
    print("\n".join(extra))
    command = "    .venv/bin/python benchmarks/scaling.py " + " ".join(
        [
            f"--conversations {args.conversations}",
            f"--seed {args.seed}",
            f"--scale-out-at {args.scale_out_at:g}",
            f"--scale-in-at {args.scale_in_at:g}",
            f"--window {args.window:g}",
        ]
    )
    report = f"""# Scaling 8 -> 10 -> 8 replicas in the middle of the multi-turn workload

Issue 4, last bullet. Generated by `benchmarks/scaling.py` ({time.monotonic() - started:.0f} s wall):

{command}

The simulator (`lab/extproc_lab/sim/dynamic.py`) replays vLLM's multi-turn workload shape
(`multi_turn({args.conversations}, seed={args.seed})`: 12 new conversations a second, 10 s mean
think time) on `llama-8b-h100` replica models with the default `extproc` profile. At
{args.scale_out_at:g} s the router's `set_replicas` is called with 10 replicas (the simulator
gains two replica models), at {args.scale_in_at:g} s with the first 8 again (replica-8 and
replica-9 leave; their models finish what they hold and get nothing new). Modes:

- **prewarm**: default `rebalance:` settings; the real `Prewarmer` (token bucket 5/s, burst 5,
  queue 256) is pumped by the virtual clock and each pre-warm becomes a prefill-only request
  (max_tokens 1) with the session's latest prompt on the target replica model;
- **default**: `RebalanceSettings()` — no moves on a join (new sessions fill the newcomers);
  a leaving replica's sessions move to their next ring replica, without pre-warming.
- **prewarm**: `RebalanceSettings(move_on_join=True, prewarm=PrewarmSettings(enabled=True))` — a
  newcomer's ring share moves, pre-warmed.
- **no-prewarm**: `RebalanceSettings(move_on_join=True, prewarm=PrewarmSettings(enabled=False))` — sessions move,
  nothing is warmed;
- **no-rebalance**: `RebalanceSettings(enabled=False)` — the rebalancer moves nothing.

Columns: *live sessions* are the rebalancer ledger's live sessions at the change (seen within the
session TTL, 600 s, so finished conversations count too); *moved* are those the rebalancer re-pinned
(ring share of the newcomers, or the leavers' sessions); *next turns* are sessions whose first turn
in the {args.window:g} s after the change follows a turn before it, *on another replica* the share of
those that landed elsewhere than their previous turn, and *their hit ratio* the token hit ratio of
those relocated turns. Hit ratio (cached prompt tokens / prompt tokens) and TTFT p99 are over
requests arriving in the {args.window:g} s before and after the change.

{text}

{chr(10).join(extra)}
"""
    Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
