"""``extproc bench routing``: every policy over the same workload in the simulator, one table.

Each policy runs in its own worker process (spawned with ``PYTHONHASHSEED=0``, so set iteration
order, and with it every tie, is the same on every run): the figures depend only on the workload,
the replicas, the seed and the code. The ceilings (``pooled``, ``ideal``) are computed in the
main process on the workload's nominal request order.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.api import Config, load_config, with_overrides
from extproc_lab.bench.policies import (
    ALL,
    CEILINGS,
    EXTRA,
    HOT_KEYS,
    KV_EVENTS,
    KV_EVENTS_DELAY_S,
    NO_OBJECTIVES,
    OURS,
    PEERS,
    policy_profile,
    scrape_interval,
)
from extproc_lab.bench.progress import ProgressBar
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.timing import ReplicaProfile, get_profile
from extproc_lab.sim.ceilings import ceilings
from extproc_lab.sim.dynamic import DynamicSimulation, window_figures
from extproc_lab.sim.figures import figures, hit_ratio_series, load_series
from extproc_lab.sim.objectives import goodput_figures
from extproc_lab.sim.pressure import working_set
from extproc_lab.sim.simulator import Simulation
from extproc_lab.sim.workload import Workload


@dataclass(frozen=True)
class BenchSetup:
    """Everything a run depends on (picklable: workers rebuild the workload from it)."""

    workload: WorkloadSpec
    replicas: int = 8
    profile: str = "llama-8b-h100"
    seed: int = 7
    router_config: str | None = None
    variants: tuple[tuple[str, str], ...] = ()
    window_s: float | None = None
    kv_blocks: int | None = None
    """KV blocks per replica (the profile's ``num_gpu_blocks``); None keeps the profile's."""
    slow_profile: str | None = None
    """A mixed pool: the last ``slow_replicas`` replicas of this profile (same KV blocks)."""
    slow_replicas: int = 0

    def replica_profile(self) -> ReplicaProfile:
        """The replica profile, with ``kv_blocks`` blocks if given."""
        profile = get_profile(self.profile)
        return dataclasses.replace(profile, num_gpu_blocks=self.kv_blocks) if self.kv_blocks else profile

    def slower(self) -> tuple[int, ReplicaProfile] | None:
        """The mixed pool's slower replicas, ``(count, profile)``; None for a uniform pool."""
        if not self.slow_profile or self.slow_replicas <= 0:
            return None
        profile = get_profile(self.slow_profile)
        if self.kv_blocks:
            profile = dataclasses.replace(profile, num_gpu_blocks=self.kv_blocks)
        return min(self.slow_replicas, self.replicas), profile

    def config(self) -> Config:
        """The router's config (its ``profile:`` is the ``extproc`` policy)."""
        return load_config(self.router_config) if self.router_config else Config()

    def variant_profiles(self) -> dict[str, Mapping[str, Any]]:
        """``--variant NAME=FILE`` profiles: a router config's ``profile:`` or a bare profile."""
        out: dict[str, Mapping[str, Any]] = {}
        for name, path in self.variants:
            raw = yaml.safe_load(Path(path).read_text()) or {}
            out[name] = raw.get("profile", raw) if isinstance(raw, Mapping) else {}
        return out


@dataclass
class PolicyResult:
    """One policy's figures and time series."""

    name: str
    figures: dict[str, Any]
    hit_series: list[float | None] = field(default_factory=list)
    load_series: list[list[float]] = field(default_factory=list)
    window_s: float = 0.0
    wall_s: float = 0.0


_WORKLOAD_CACHE: dict[WorkloadSpec, Workload] = {}
_WORKER: dict[str, Any] = {}
"""In a worker process: ``progress``, the queue its simulations report to."""


def _workload(spec: WorkloadSpec) -> Workload:
    wl = _WORKLOAD_CACHE.get(spec)
    if wl is None:
        _WORKLOAD_CACHE.clear()  # one workload per worker at a time
        wl = _WORKLOAD_CACHE[spec] = spec.build()
    return wl


def _init_worker(progress: Any) -> None:
    _WORKER["progress"] = progress


def run_policy(setup: BenchSetup, policy: str, on_progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Simulate one policy over the setup's workload."""
    started = time.monotonic()
    workload = _workload(setup.workload)
    replica = setup.replica_profile()
    config = setup.config()
    if policy == HOT_KEYS:
        config = with_overrides(config, hot_keys=config.hot_keys.model_copy(update={"enabled": True}))
    variants = setup.variant_profiles()
    progress = _WORKER.get("progress")
    if on_progress is None and progress is not None:

        def on_progress(done: int) -> None:
            progress.put((policy, done))

    changes = tuple(workload.info.get("changes", ()))
    # A workload that scales the fleet (hot-prefix) is replayed with its membership changes.
    args = (
        workload,
        replica,
        setup.replicas,
        lambda probe: policy_profile(policy, probe, setup.seed, replica, config, variants),
    )
    options: dict[str, Any] = {
        "policy": policy,
        "config": config,
        "scrape_interval_s": scrape_interval(policy),
        "window_s": setup.window_s,
        "kv_events_delay_s": KV_EVENTS_DELAY_S if policy == KV_EVENTS else None,
        "objectives": policy != NO_OBJECTIVES,
        "slower": setup.slower(),
    }
    sim = DynamicSimulation(*args, changes=changes, **options) if changes else Simulation(*args, **options)
    run = sim.run(on_progress)
    figs = figures(run)
    if setup.workload.objectives:
        figs.update(goodput_figures(run.outcomes, workload.requests))
    if changes:
        at = changes[0][0]
        before, after = window_figures(run.outcomes, at - 60.0, at), window_figures(run.outcomes, at, at + 60.0)
        figs["join"] = {
            "at_s": at,
            "ttft_p99_before_s": round(before.ttft_p99_s, 4),
            "ttft_p99_after_s": round(after.ttft_p99_s, 4),
            "hit_ratio_before": round(before.hit_ratio, 4),
            "hit_ratio_after": round(after.hit_ratio, 4),
        }
    return PolicyResult(
        name=policy,
        figures=figs,
        hit_series=hit_ratio_series(run),
        load_series=load_series(run),
        window_s=run.window_s,
        wall_s=time.monotonic() - started,
    )


@dataclass
class BenchResult:
    """A whole run: the workload's summary, every policy's result, the ceilings."""

    setup: BenchSetup
    workload: dict[str, Any]
    results: dict[str, PolicyResult]
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """``{"default_policy", "policies": {name: figures}, "workload", "setup", "series"}``."""
        s = self.setup
        return {
            "default_policy": OURS,
            "policies": {name: r.figures for name, r in self.results.items()},
            "workload": self.workload,
            "setup": {
                "replicas": s.replicas,
                "replica_profile": s.profile,
                "slow_profile": s.slow_profile,
                "slow_replicas": s.slow_replicas if s.slow_profile else 0,
                "kv_blocks": s.kv_blocks,
                "seed": s.seed,
                "rate": s.workload.rate,
                "objectives": [str(c) for c in s.workload.objectives],
                "router_config": s.router_config,
                "variants": dict(s.variants),
            },
            "series": {
                name: {
                    "window_s": r.window_s,
                    "hit_ratio": [None if v is None else round(v, 4) for v in r.hit_series],
                    "tokens_per_s": r.load_series,
                }
                for name, r in self.results.items()
            },
        }


def run_bench(
    setup: BenchSetup,
    policies: Sequence[str],
    jobs: int = 2,
    show_progress: bool = True,
    in_process: bool = False,
) -> BenchResult:
    """Run every policy (ceilings included) and collect the results, in ``policies`` order."""
    started = time.monotonic()
    variants = setup.variant_profiles()
    unknown = [p for p in policies if p not in ALL and p not in EXTRA and p not in variants]
    if unknown:
        raise ValueError(f"unknown policies: {', '.join(unknown)}; known: {', '.join([*ALL, *EXTRA, *variants])}")
    workload = setup.workload.build()
    replica = setup.replica_profile()
    routed = [p for p in policies if p not in CEILINGS]
    results: dict[str, PolicyResult] = {}
    total = len(workload) * len(routed)
    bar = ProgressBar(total, f"{setup.workload.label} x{len(routed)}") if show_progress and routed else None
    if in_process:
        for i, name in enumerate(routed):
            offset = i * len(workload)

            def note(done: int, name: str = name, offset: int = offset) -> None:
                if bar is not None:
                    bar.update(offset + done, name)

            results[name] = run_policy(setup, name, note)
    elif routed:
        results.update(_run_spawned(setup, routed, jobs, bar, len(workload)))
    if bar is not None:
        bar.update(total, "done", force=True)
        bar.close()
    window = next((r.window_s for r in results.values()), setup.window_s or 60.0)
    ceiling_results = {
        c.name: c for c in ceilings(workload, setup.replicas, replica.num_gpu_blocks, replica.block_size, window)
    }
    ordered: dict[str, PolicyResult] = {}
    for name in policies:
        if name in CEILINGS:
            c = ceiling_results[name]
            ordered[name] = PolicyResult(
                name,
                {
                    "hit_ratio": round(c.hit_ratio, 4),
                    "prefill_tokens": c.prefill_tokens,
                    "prompt_tokens": c.prompt_tokens,
                },
                list(c.series),
                [],
                window,
            )
        else:
            ordered[name] = results[name]
    pressure = working_set(workload, setup.replicas, replica.num_gpu_blocks, replica.block_size)
    summary = {
        **workload.summary(),
        "kv_blocks_per_replica": replica.num_gpu_blocks,
        "working_set_ratio": round(pressure.mean_ratio, 4),
        "working_set_peak_ratio": round(pressure.peak_ratio, 4),
    }
    return BenchResult(setup, summary, ordered, time.monotonic() - started)


def _run_spawned(
    setup: BenchSetup, policies: Sequence[str], jobs: int, bar: ProgressBar | None, per_policy: int
) -> dict[str, PolicyResult]:
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Queue()
    done: dict[str, int] = dict.fromkeys(policies, 0)
    results: dict[str, PolicyResult] = {}
    saved = os.environ.get("PYTHONHASHSEED")
    # Spawned interpreters read it at start: equal hash order in every worker, on every run.
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        with ProcessPoolExecutor(
            max_workers=max(1, jobs), mp_context=ctx, initializer=_init_worker, initargs=(progress,)
        ) as pool:
            futures: dict[Future[PolicyResult], str] = {pool.submit(run_policy, setup, p): p for p in policies}
            pending = set(futures)
            while pending:
                try:
                    name, count = progress.get(timeout=0.2)
                    done[name] = count
                except queue.Empty:
                    pass
                for f in [f for f in pending if f.done()]:
                    pending.discard(f)
                    r = f.result()
                    results[r.name] = r
                    done[r.name] = per_policy
                if bar is not None:
                    running = [p for p in policies if 0 < done[p] < per_policy]
                    bar.update(sum(done.values()), ",".join(running))
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    return results


# --- the report ------------------------------------------------------------------------------

COLUMNS = (
    ("policy", 20),
    ("hit ratio", 9),
    ("offered", 8),
    ("captured", 9),
    ("prefill Mtok", 12),
    ("TTFT p50", 9),
    ("TTFT p99", 9),
    ("e2e p50", 8),
    ("e2e p99", 8),
    ("req/s", 7),
    ("CV req", 7),
    ("CV busy", 8),
    ("CV prefill", 10),
    ("stayed", 7),
    ("preempt", 8),
)
GOODPUT_COLUMNS = (("SLO met", 8), ("goodput tok/s", 13))
"""Added when the workload carries latency objectives."""


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt)


def format_table(result: BenchResult, markdown: bool = False) -> str:
    """One row per policy: hit ratio, the reuse offered and the share of it captured (where the hit
    ratio goes), prefill tokens, TTFT and end-to-end p50/p99, throughput,
    load CV (requests, busy time, prefill tokens per replica), share of sticky turns that stayed;
    with latency objectives, the share of requests that met theirs and their output tokens/s."""
    slo = bool(result.setup.workload.objectives)
    columns = COLUMNS + GOODPUT_COLUMNS if slo else COLUMNS
    rows = []
    for name, r in result.results.items():
        f = r.figures
        label = f"{name} *" if name == OURS else name
        if "ttft_p50_s" not in f:
            blank = ["-"] * (len(columns) - 5)
            rows.append(
                [label, _cell(f["hit_ratio"], ".1%"), "-", "-", _cell(f["prefill_tokens"] / 1e6, ".2f"), *blank]
            )
            continue
        rows.append(
            [
                label,
                _cell(f["hit_ratio"], ".1%"),
                _cell(f.get("reuse_offered"), ".1%"),
                _cell(f.get("reuse_captured"), ".1%"),
                _cell(f["prefill_tokens"] / 1e6, ".2f"),
                _cell(f["ttft_p50_s"], ".3f"),
                _cell(f["ttft_p99_s"], ".3f"),
                _cell(f["e2e_p50_s"], ".2f"),
                _cell(f["e2e_p99_s"], ".2f"),
                _cell(f["throughput_rps"], ".2f"),
                _cell(f["load_cv"], ".3f"),
                _cell(f["load_cv_busy"], ".3f"),
                _cell(f["load_cv_prefill"], ".3f"),
                _cell(f["sticky_stayed"], ".0%"),
                _cell(f.get("preemptions"), "d"),
            ]
        )
        if slo:
            rows[-1] += [_cell(f.get("slo_met"), ".1%"), _cell(f.get("goodput_tokens_per_s"), ".0f")]
    heads = [h for h, _ in columns]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [w for _, w in columns]
    lines = [
        "".join(h.ljust(w) if i == 0 else h.rjust(w + 1) for i, (h, w) in enumerate(zip(heads, widths, strict=True)))
    ]
    for row in rows:
        lines.append(
            "".join(c.ljust(w) if i == 0 else c.rjust(w + 1) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
    return "\n".join(lines)


def verdict(result: BenchResult, tolerance: float = 0.02) -> list[str]:
    """Where ours is not at least as good as the best peer on TTFT p99 and hit ratio (within
    ``tolerance``), and where it is strictly better; one line each. Peers are the other routers'
    policies (not the ceilings or ``--variant`` profiles)."""
    ours = result.results.get(OURS)
    if ours is None:
        return []
    peers = {n: r.figures for n, r in result.results.items() if n in PEERS and "ttft_p99_s" in r.figures}
    if not peers:
        return []
    f = ours.figures
    best_hit = max(peers.items(), key=lambda kv: kv[1]["hit_ratio"])
    best_p99 = min(peers.items(), key=lambda kv: kv[1]["ttft_p99_s"])
    out = []
    if f["hit_ratio"] < best_hit[1]["hit_ratio"] * (1 - tolerance):
        out.append(f"hit ratio: {OURS} {f['hit_ratio']:.1%} < {best_hit[0]} {best_hit[1]['hit_ratio']:.1%}")
    if f["ttft_p99_s"] > best_p99[1]["ttft_p99_s"] * (1 + tolerance):
        out.append(f"TTFT p99: {OURS} {f['ttft_p99_s']:.3f}s > {best_p99[0]} {best_p99[1]['ttft_p99_s']:.3f}s")
    better_hit = f["hit_ratio"] > best_hit[1]["hit_ratio"]
    better_p99 = f["ttft_p99_s"] < best_p99[1]["ttft_p99_s"]
    if not out:
        out.append("at least as good as every peer on TTFT p99 and hit ratio (within 2%)")
    if not (better_hit or better_p99):
        out.append("strictly better than every peer on neither")
    pooled = result.results.get("pooled")
    if pooled and pooled.figures["hit_ratio"]:
        out.append(f"hit ratio {f['hit_ratio'] / pooled.figures['hit_ratio']:.1%} of pooled")
    rr = result.results.get("round_robin")
    if rr and rr.figures.get("ttft_p99_s"):
        out.append(f"TTFT p99 {f['ttft_p99_s'] / rr.figures['ttft_p99_s']:.2f}x round robin's")
    return out
