"""Scorers proposed for our default profile, measured with ``extproc bench routing --variant``
before anyone adopts them (benchmarks/routing.md has the figures). Registered by name like every
plugin; no profile uses them unless its config names them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from extproc.request.features import CHARS_PER_TOKEN
from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState, Scorer


@dataclass(slots=True)
class PrefillWaitScorer:
    """The prefill a request would wait for on each replica, prefix cache and load in one unit.

    In prompt tokens: the prefill the gateway sent there and has not seen answered yet
    (``pending_prefill_tokens``), plus the part of this prompt not believed cached there (the
    store's prefix match). The score is ``(least + floor) / (this + floor)``: the replica with the
    least to compute scores 1, one with twice as much (beyond ``floor_tokens``) about 0.5. A long
    cached prefix on a replica busy with other long prefills no longer wins by its match alone;
    a short prompt hardly cares (the floor keeps small differences from mattering).
    """

    floor_tokens: int = 2048
    block_chars: int = 64
    name: str = "prefill_wait"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Relative expected prefill wait, per candidate."""
        f = cycle.features
        prompt = f.estimated_prompt_tokens
        per_block = self.block_chars // CHARS_PER_TOKEN
        matches = cycle.view.prefix_matches
        wait = {
            c.name: c.pending_prefill_tokens + max(0, prompt - matches.get(c.name, 0) * per_block) for c in candidates
        }
        least = min(wait.values(), default=0)
        floor = self.floor_tokens
        return {name: (least + floor) / (w + floor) for name, w in wait.items()}


CANDIDATE_SCORERS: dict[str, Callable[..., Scorer]] = {"prefill_wait": PrefillWaitScorer}
