"""How hard a workload presses on a fleet's KV cache: its working set over the fleet's capacity.

A prompt block is *live* from its first use until its last: a cache that is to hit on its last use
must hold it all that time. The working set at a request is the tokens of the blocks live then;
over the fleet's KV tokens (replicas x blocks x block size) it says how much of what will be
reused the fleet can hold at once: under 1 a fleet that routed perfectly could keep it all, above
1 something must be recomputed whatever the router does. Computed on the nominal request order,
as the ceilings are, so every policy faces the same figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc_lab.sim.workload import Workload


@dataclass(frozen=True)
class Pressure:
    """Working-set figures of a workload against a fleet's KV capacity."""

    capacity_tokens: int
    mean_live_tokens: float
    peak_live_tokens: int

    @property
    def mean_ratio(self) -> float:
        """Mean live prompt tokens over the fleet's KV tokens."""
        return self.mean_live_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def peak_ratio(self) -> float:
        """Peak live prompt tokens over the fleet's KV tokens."""
        return self.peak_live_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


def working_set(workload: Workload, replicas: int, num_gpu_blocks: int, block_size: int = 16) -> Pressure:
    """The workload's live prompt tokens (mean and peak over its requests) against the capacity of
    ``replicas`` replicas of ``num_gpu_blocks`` blocks."""
    order = workload.nominal_order()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    size: dict[int, int] = {}
    for i, r in enumerate(order):
        n = len(r.keys)
        for j, key in enumerate(r.keys):
            if key not in first:
                first[key] = i
                size[key] = r.tail_span if j == n - 1 else r.key_span
            last[key] = i
    # A difference array over request positions: a block counts from its first use to its last.
    delta = [0] * (len(order) + 1)
    for key, start in first.items():
        end = last[key]
        if end > start:  # used once: nothing to keep
            delta[start] += size[key]
            delta[end + 1] -= size[key]
    live = total = peak = 0
    for i in range(len(order)):
        live += delta[i]
        total += live
        peak = max(peak, live)
    mean = total / len(order) if order else 0.0
    return Pressure(replicas * num_gpu_blocks * block_size, mean, peak)
