"""Latency objectives in the simulator: classes drawn per conversation, goodput."""

from __future__ import annotations

import pytest

from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.sim.generators import multi_turn
from extproc_lab.sim.objectives import ObjectiveClass, assign, goodput_figures, met, parse_mix, uniform
from extproc_lab.sim.simulator import Outcome


def test_parse_mix_reads_classes_and_rejects_nonsense() -> None:
    assert parse_mix("chat:0.7:300:40, batch:0.3:-:-") == (
        ObjectiveClass("chat", 0.7, 300.0, 40.0),
        ObjectiveClass("batch", 0.3, None, None),
    )
    for bad in ("chat:0.7:300", "chat:x:300:40", "chat:0:300:40", "chat:1:-5:-", ""):
        with pytest.raises(ValueError):
            parse_mix(bad)
    assert uniform(None, None) == ()
    assert uniform(200, None) == (ObjectiveClass("all", 1.0, 200, None),)


def test_every_turn_of_a_conversation_keeps_its_class() -> None:
    wl = assign(multi_turn(60, seed=3), parse_mix("a:1:100:-,b:1:-:20"), seed=7)
    by_session: dict[str | None, set[str]] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, set()).add(r.slo_class)
    assert all(len(classes) == 1 for classes in by_session.values())
    assert {c for classes in by_session.values() for c in classes} == {"a", "b"}
    r = next(r for r in wl.requests if r.slo_class == "a")
    assert r.headers()["x-slo-ttft-ms"] == "100" and "x-slo-tpot-ms" not in r.headers()
    # The spec applies them, the same on every build.
    spec = WorkloadSpec(limit=50, objectives=parse_mix("a:1:100:-,b:1:-:20"))
    assert [r.slo_class for r in spec.build().requests] == [r.slo_class for r in spec.build().requests]


def test_goodput_counts_the_tokens_of_requests_that_met_their_objectives() -> None:
    wl = assign(multi_turn(2, seed=3), (ObjectiveClass("all", 1.0, 100.0, 10.0),), seed=1)
    req = wl.requests[0]
    assert met(req, 0.0, 0.05, 0.05 + 0.009 * 10, 11)
    assert not met(req, 0.0, 0.2, 0.3, 11)  # first token late
    assert not met(req, 0.0, 0.05, 0.05 + 0.02 * 10, 11)  # tokens too far apart

    def outcome(i: int, first: float, finish: float) -> Outcome:
        return Outcome(i, 0, 0.0, first, finish, 10, 0, 10, 11, 0, None, None)

    figs = goodput_figures([outcome(0, 0.05, 0.1), outcome(1, 0.5, 1.0)], wl.requests)
    assert figs["slo_met"] == 0.5
    assert figs["goodput_tokens_per_s"] == 11.0  # 11 tokens over a 1 s run
    assert figs["slo_classes"]["all"]["requests"] == 2
