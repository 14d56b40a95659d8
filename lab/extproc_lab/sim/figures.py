"""The figures of a simulated run: hit ratio, latency percentiles, throughput, load balance."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from extproc_lab.sim.simulator import SimRun
from extproc_lab.stats import percentile


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean; 0 for no load)."""
    if not values:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def figures(run: SimRun) -> dict[str, Any]:
    """The JSON figures of one policy's run (keys as ``extproc bench routing --json`` writes them)."""
    out = run.outcomes
    prompt = sum(o.prompt_tokens for o in out)
    cached = sum(o.cached_tokens for o in out)
    ttft = sorted(o.first_token - o.arrival for o in out)
    e2e = sorted(o.finish - o.arrival for o in out)
    start = min((o.arrival for o in out), default=0.0)
    end = max((o.finish for o in out), default=0.0)
    n = len(run.replicas)
    per_replica = [0] * n
    for o in out:
        per_replica[o.replica] += 1
    sticky = [o.stayed for o in out if o.stayed is not None]
    makespan = end - start
    blocks, offered, captured = run.reuse_blocks
    return {
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        # Where the hit ratio goes (extproc.fleet.cache.reuse): the reuse the workload offered, the
        # share of it the policy captured.
        "reuse_offered": round(offered / blocks, 4) if blocks else None,
        "reuse_captured": round(captured / offered, 4) if offered else None,
        "prefill_tokens": sum(run.prefill_tokens),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else 0.0,
        "e2e_p50_s": round(percentile(e2e, 0.5), 4),
        "e2e_p99_s": round(percentile(e2e, 0.99), 4),
        "throughput_rps": round(len(out) / makespan, 3) if makespan > 0 else 0.0,
        "output_tokens_per_s": round(sum(o.output_tokens for o in out) / makespan, 1) if makespan > 0 else 0.0,
        "load_cv": round(cv(per_replica), 4),
        "load_cv_busy": round(cv(run.busy_s), 4),
        "load_cv_prefill": round(cv(run.prefill_tokens), 4),
        "sticky_stayed": round(sum(sticky) / len(sticky), 4) if sticky else None,
        "preemptions": sum(run.preemptions),
        "requests": len(out),
        "requests_per_replica": per_replica,
        "busy_s_per_replica": [round(b, 2) for b in run.busy_s],
        "decisions": run.decisions,
        "makespan_s": round(makespan, 2),
    }


def hit_ratio_series(run: SimRun, min_requests: int = 5) -> list[float | None]:
    """Token hit ratio of the requests arriving in each window (None where fewer than
    ``min_requests`` arrived: too few to say)."""
    per: list[list[int]] = []
    for o in run.outcomes:
        w = int(o.arrival // run.window_s)
        while len(per) <= w:
            per.append([0, 0, 0])
        per[w][0] += o.prompt_tokens
        per[w][1] += o.cached_tokens
        per[w][2] += 1
    return [c / p if p and k >= min_requests else None for p, c, k in per]


def load_series(run: SimRun) -> list[list[float]]:
    """Per replica, tokens computed per second in each window (prefill and decode; padded to
    equal lengths)."""
    width = max((len(s) for s in run.tokens_series), default=0)
    return [[round(v / run.window_s, 1) for v in s] + [0.0] * (width - len(s)) for s in run.tokens_series]
