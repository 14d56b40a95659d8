"""The do-nothing processor: prebuilt answers, its streams taking the targets in turn."""

from __future__ import annotations

from typing import Any

from extproc_lab.bench.bare_processor import _Targets


def _routed_to(answers: dict[str, Any]) -> str:
    (option,) = answers["request_body"].request_body.response.header_mutation.set_headers
    return str(option.header.raw_value.decode())


def test_streams_take_the_targets_in_turn_and_one_target_takes_all() -> None:
    spread = _Targets("x-target-cluster", "replica-0,replica-1,replica-2")
    assert [_routed_to(spread.next()) for _ in range(6)] == ["replica-0", "replica-1", "replica-2"] * 2
    one = _Targets("x-target-cluster", "replica-0")
    assert {_routed_to(one.next()) for _ in range(3)} == {"replica-0"}
