"""The round-robin picker: every candidate in turn, whatever the scores."""

from __future__ import annotations

from extproc.routing.pickers import RoundRobinPicker
from extproc.routing.registry import build_profile


class Candidate:
    def __init__(self, name: str) -> None:
        self.name = name


class Cycle:
    def __init__(self, record: bool = True) -> None:
        self.record = record


def test_every_candidate_in_turn_whatever_the_scores() -> None:
    picker = RoundRobinPicker()
    candidates = [Candidate("b"), Candidate("a"), Candidate("c")]
    firsts = [picker.pick(Cycle(), candidates, {"a": 9.0})[0].name for _ in range(6)]  # type: ignore[arg-type]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert [c.name for c in picker.pick(Cycle(), candidates, {})] == ["a", "b", "c"]  # type: ignore[arg-type]
    assert picker.pick(Cycle(), [], {}) == []  # type: ignore[arg-type]


def test_a_decision_not_carried_out_does_not_advance_it() -> None:
    # Explain shows where the next request goes: asking twice must not change the answer.
    picker = RoundRobinPicker()
    candidates = [Candidate("a"), Candidate("b")]
    explained = [picker.pick(Cycle(record=False), candidates, {})[0].name for _ in range(3)]  # type: ignore[arg-type]
    assert explained == ["a", "a", "a"]
    assert picker.pick(Cycle(), candidates, {})[0].name == "a"  # type: ignore[arg-type]
    assert picker.pick(Cycle(), candidates, {})[0].name == "b"  # type: ignore[arg-type]


def test_a_profile_may_name_it() -> None:
    assert build_profile({"picker": {"type": "in_turn"}}).picker.name == "in_turn"
