"""The round-robin picker: every candidate in turn, whatever the scores."""

from __future__ import annotations

from extproc.routing.pickers import RoundRobinPicker
from extproc.routing.registry import build_profile


class Candidate:
    def __init__(self, name: str) -> None:
        self.name = name


def test_every_candidate_in_turn_whatever_the_scores() -> None:
    picker = RoundRobinPicker()
    candidates = [Candidate("b"), Candidate("a"), Candidate("c")]
    firsts = [picker.pick(None, candidates, {"a": 9.0})[0].name for _ in range(6)]  # type: ignore[arg-type]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert [c.name for c in picker.pick(None, candidates, {})] == ["a", "b", "c"]  # type: ignore[arg-type]
    assert picker.pick(None, [], {}) == []  # type: ignore[arg-type]


def test_a_profile_may_name_it() -> None:
    assert build_profile({"picker": {"type": "in_turn"}}).picker.name == "in_turn"
