"""The built-in pickers: in turn (a baseline that ignores the cache) and the highest weighted
score (:class:`~extproc.routing.plugins.Picker`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState


@dataclass(slots=True)
class RoundRobinPicker:
    """Every candidate in turn, by name, whatever the scores: a baseline that ignores the cache, to
    compare the share of the offered reuse it captures (``extproc admin hit-ratio``) with the
    scoring profile's. Each decision carried out advances it; Explain and a held request's
    re-judgement do not (``CycleState.record``), so Explain says where the next request goes."""

    name: str = field(default="in_turn", init=False)
    _turn: int = field(default=0, init=False, repr=False)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates from the next one in turn."""
        ordered = sorted(candidates, key=lambda c: c.name)
        if not ordered:
            return ordered
        start = self._turn % len(ordered)
        if cycle.record:
            self._turn += 1
        return ordered[start:] + ordered[:start]


@dataclass(slots=True)
class MaxScorePicker:
    """Highest total first; ties go to the lighter replica, then to the name (deterministic)."""

    name: str = "max_score"

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Order candidates best first."""
        return sorted(candidates, key=lambda c: (-totals.get(c.name, 0.0), c.work(256), c.name))
