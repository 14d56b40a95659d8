"""The tiers a KV block can be held on, and what a block on a slower one is worth in a match.

vLLM's offloading connectors copy blocks to CPU memory or storage and say so (``medium`` on
``BlockStored``/``BlockRemoved``); the index (:mod:`.index`) keeps one bit per tier per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"
_TIER_BITS = 3


def tier_of(medium: str) -> int:
    """A ``medium`` as the index's tier: 0 the GPU (the engine's own pool), 1 CPU memory, 2 any
    other (vLLM's ``STORAGE``; a name it may add later is taken as the slowest)."""
    name = medium.upper()
    return 0 if name == GPU else 1 if name == CPU else 2


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What a block held only on a slower tier is worth in a match, against 1 for the GPU: it is
    loaded rather than computed, which costs time and bandwidth too. The defaults are the peers':
    llm-d scores a CPU block 0.8 of a GPU one, Dynamo weighs host memory 0.75 and disk 0.25."""

    cpu: float = 0.8
    storage: float = 0.25


DEFAULT_WEIGHTS = TierWeights()
"""The peers' weights (a default argument's value: one frozen instance)."""

OFFLOAD_WEIGHT = DEFAULT_WEIGHTS.cpu
"""A block held in CPU memory only is worth this much of one on the GPU (the default weight)."""
