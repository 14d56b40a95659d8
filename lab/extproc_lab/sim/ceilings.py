"""Hit-ratio ceilings of a workload, computed on its request stream without any routing.

- ``pooled``: one LRU cache with the whole fleet's capacity receiving every request, as if the
  fleet were one replica. Routing over N replicas cannot beat it on hit ratio without luck in
  eviction order: goals are stated against it.
- ``ideal``: one cache without bound (the share of prompt tokens seen before).

Both use the requests in their nominal order (:meth:`~extproc_lab.sim.workload.Workload.nominal_order`),
the same for every policy, and count hits as the replicas do: whole cached blocks of the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc_lab.replica.cache import WeightedPrefixCache
from extproc_lab.sim.workload import Workload


@dataclass
class Ceiling:
    """A ceiling's figures: token hit ratio, prefill tokens left, and the hit ratio per window."""

    name: str
    hit_ratio: float
    prefill_tokens: int
    prompt_tokens: int
    series: list[float] = field(default_factory=list)


def ceiling(
    workload: Workload, name: str, num_blocks: int | None, block_size: int = 16, window_s: float = 60.0
) -> Ceiling:
    """Replay ``workload`` through one cache of ``num_blocks`` blocks (None: unbounded)."""
    cache = WeightedPrefixCache(num_blocks)
    when: dict[int, float] = {}
    prompt_total = cached_total = 0
    per_window: list[list[int]] = []
    for r in workload.nominal_order():
        t = r.arrival_s if r.after < 0 else when[r.after] + r.arrival_s
        when[r.index] = t
        n = len(r.keys)
        sizes = [r.key_span // block_size] * n
        if n:
            sizes[-1] = r.tail_span // block_size
        cached = min(r.prompt_tokens, cache.match_and_store(r.keys, sizes) * block_size)
        prompt_total += r.prompt_tokens
        cached_total += cached
        w = int(t // window_s)
        while len(per_window) <= w:
            per_window.append([0, 0])
        per_window[w][0] += r.prompt_tokens
        per_window[w][1] += cached
    series = [c / p if p else 0.0 for p, c in per_window]
    ratio = cached_total / prompt_total if prompt_total else 0.0
    return Ceiling(name, ratio, prompt_total - cached_total, prompt_total, series)


def ceilings(
    workload: Workload, replicas: int, num_gpu_blocks: int, block_size: int = 16, window_s: float = 60.0
) -> list[Ceiling]:
    """``pooled`` (the fleet's capacity in one cache) and ``ideal`` (no bound)."""
    return [
        ceiling(workload, "pooled", replicas * num_gpu_blocks, block_size, window_s),
        ceiling(workload, "ideal", None, block_size, window_s),
    ]
