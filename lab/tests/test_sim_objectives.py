"""Latency objectives in the simulator: classes drawn per conversation, goodput."""

from __future__ import annotations

import pytest

from extproc.api import Config, QueueClass, QueueSettings
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import merge, multi_turn, unique_prompts
from extproc_lab.sim.objectives import ObjectiveClass, assign, goodput_figures, met, parse_mix, uniform
from extproc_lab.sim.priority import PriorityRun, PrioritySimulation
from extproc_lab.sim.simulator import Outcome
from extproc_lab.sim.workload import Workload


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


def _overload(seconds: float = 20.0, rate: float = 100.0) -> Workload:
    """Premium (loose objectives) and standard (tight ones) at about 1.5x two replicas' capacity."""
    parts = []
    for k, (tenant, share, ttft, tpot) in enumerate((("premium", 0.3, 1000.0, 80.0), ("standard", 0.7, 500.0, 50.0))):
        part = unique_prompts(
            round(rate * share * seconds), seed=3 + k, qps=rate * share, mean_prompt_tokens=300, mean_output_tokens=100
        )
        for r in part.requests:
            r.tenant, r.slo_class, r.slo_ttft_ms, r.slo_tpot_ms = tenant, tenant, ttft, tpot
        parts.append(part)
    return merge("premium+standard", parts)


def _run(workload: Workload, queueing: QueueSettings) -> PriorityRun:
    sim = PrioritySimulation(
        workload, get_profile("llama-8b-h100"), 2, None, Config(queueing=queueing), lambda r: r.tenant
    )
    return sim.run()


def _premium_met(workload: Workload, run: PriorityRun) -> float:
    premium = [s for s in run.served if s.request_class == "premium"]
    req = workload.requests
    return sum(met(req[s.index], s.arrival, s.first_token, s.finish, s.output_tokens) for s in premium) / len(premium)


def test_shedding_the_tighter_class_on_a_predicted_miss_lets_the_highest_class_meet_its_objectives() -> None:
    best = QueueClass(priority=1, max_wait_s=1e9, max_queued=10**9)
    off = _run(_overload(), QueueSettings(default=best))
    shed = _run(
        _overload(), QueueSettings(default=best, classes={"standard": best.model_copy(update={"on_miss": "shed"})})
    )
    assert off.refused == {} and len(off.served) == len(_overload().requests)
    refused_classes = {off_class for i, off_class in shed.classes.items() if i in shed.refusals}
    assert shed.refused.get("objective", 0) > 0 and refused_classes == {"standard"}  # premium is never shed
    assert _premium_met(_overload(), shed) > _premium_met(_overload(), off) + 0.2


def test_a_class_that_queues_on_a_miss_is_held_and_then_served() -> None:
    best = QueueClass(priority=1, max_wait_s=1e9, max_queued=10**9)
    queue = best.model_copy(update={"priority": 0, "on_miss": "queue"})
    run = _run(
        _overload(),
        QueueSettings(enabled=True, kv_threshold=1.0, queue_threshold=10**9, default=best, classes={"standard": queue}),
    )
    assert run.refused == {} and run.max_waiting > 0
    held = [s for s in run.served if s.dispatched > s.arrival]
    assert held and all(s.request_class == "standard" for s in held)
