"""What the router does with a request every candidate is predicted to miss (its class's
``on_miss``), how it judges attainment, and what Explain says of it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from extproc.adapters.admin.service import explanation_message
from extproc.adapters.admin.tables import render
from extproc.adapters.telemetry import collect
from extproc.app.plan import Planner, Refuse
from extproc.app.router import Router
from extproc.base.world import ManualWorld
from extproc.config import Config
from extproc.fleet.queueing import QueueClass, QueueSettings
from extproc.request.features import RequestFeatures, read_request
from extproc.routing.latency import LoadPoint
from extproc.routing.model import AffinityView
from extproc.routing.registry import SCORES_PROFILE
from tests.conftest import chat_body, make_config
from tests.helpers import CHAT, Clock, metric_value


def scores_config(**changes: Any) -> Config:
    # The objectives judged by the latency models' fits (warmed below), the scores profile's way:
    # under the price they judge by its own prediction (tests/unit/routing/test_price_objectives.py).
    return make_config(profile=SCORES_PROFILE, **changes)


def headers(ttft_ms: float | None = 100.0, session: str = "s", **extra: str) -> dict[str, str]:
    out = {":path": CHAT, "x-session-id": session, **extra}
    if ttft_ms is not None:
        out["x-slo-ttft-ms"] = f"{ttft_ms:g}"
    return out


def warm(router: Router, ttft_s: float = 0.5, per_running_s: float = 0.0) -> None:
    """Every replica's TTFT model warm on ``ttft_s`` plus ``per_running_s`` per request running."""
    for name in [r.replica.name for r in router.replicas.records()]:
        for i in range(64):
            running = i % 8
            router.latency.observe_ttft(name, LoadPoint(0, 0, running, 0), ttft_s + per_running_s * running)


def read(h: dict[str, str]) -> RequestFeatures:
    return read_request(h, chat_body("hi"), scores_config().features).features


def router_with(**queueing: Any) -> Router:
    return Router(scores_config(queueing=QueueSettings(**queueing)), clock=Clock())


def shed_count(router: Router, reason: str, cls: str = "default") -> float:
    return metric_value(router.metrics.requests_shed.labels(cls, reason))


async def test_a_class_that_sheds_is_refused_429_with_retry_after_when_every_replica_would_miss() -> None:
    router = router_with(default=QueueClass(on_miss="shed", retry_after_s=3))
    warm(router, 0.5)
    planner = Planner(router)
    plan = await planner.plan(headers(100), chat_body("hi"))
    assert isinstance(plan.action, Refuse)
    assert (plan.action.status, plan.action.kind, plan.action.retry_after_s) == (429, "objective", 3)
    assert shed_count(router, "objective") == 1
    assert all(router.replicas.record(n).inflight == 0 for n in [r.replica.name for r in router.replicas.records()])  # type: ignore[union-attr]
    # An objective a replica is predicted to meet, or none at all, is routed as ever.
    for h in (headers(1000), headers(None)):
        routed = await router.route(h, chat_body("hi"))
        assert routed.refusal is None and routed.decision.replica is not None
    assert shed_count(router, "objective") == 1


async def test_a_shedding_class_is_admitted_only_with_its_margin_and_best_effort_ignores_it() -> None:
    # 80 ms predicted against 100: met, with 20% of the objective left.
    shed = {"default": QueueClass(on_miss="shed", admit_margin=0.3)}
    router = router_with(**shed)
    warm(router, 0.08)
    routed = await router.route(headers(100), chat_body("hi"))
    assert routed.refusal is not None and routed.refusal.kind == "objective"
    ex = await router.explain(headers(100, session="e"), chat_body("hi"))
    assert not ex.decision.objective_missed and abs((ex.decision.objective_headroom or 0) - 0.2) < 0.01
    explained = explanation_message(ex)
    assert explained.objective_predicted == "missed" and explained.on_miss == "shed"
    assert "margin" in explained.objective_why
    # Within the margin, or for a best-effort class, it goes.
    router = router_with(default=QueueClass(on_miss="shed", admit_margin=0.1))
    warm(router, 0.08)
    assert (await router.route(headers(100), chat_body("hi"))).refusal is None
    router = router_with(default=QueueClass(on_miss="best_effort", admit_margin=0.5))
    warm(router, 0.08)
    assert (await router.route(headers(100), chat_body("hi"))).refusal is None


async def test_best_effort_the_default_routes_to_the_least_late() -> None:
    router = router_with()
    warm(router, 0.5)
    routed = await router.route(headers(100), chat_body("hi"))
    assert routed.refusal is None and routed.decision.replica is not None
    assert routed.decision.objective_missed
    assert shed_count(router, "objective") == 0


async def test_with_no_warm_model_a_shedding_class_is_routed_as_today() -> None:
    router = router_with(default=QueueClass(on_miss="shed"))
    for name in [r.replica.name for r in router.replicas.records()]:  # slow, but fewer observations than warm_after
        for _ in range(router.latency.warm_after - 1):
            router.latency.observe_ttft(name, LoadPoint(0, 0, 0, 0), 5.0)
    given, _ = router.core.inputs(read(headers(100, session="a")), AffinityView(), router.clock())
    today = router.decide(replace(given, features=replace(given.features, slo_ttft_ms=None)))
    assert router.decide(given) == today and not today.objective_missed
    with_objective = await router.route(headers(100, session="a"), chat_body("hi"))
    assert with_objective.refusal is None and with_objective.decision.replica == today.replica


async def test_a_class_that_queues_waits_until_a_replica_is_predicted_to_meet_its_objective() -> None:
    world = ManualWorld()
    router = Router(
        scores_config(queueing=QueueSettings(enabled=True, default=QueueClass(on_miss="queue", max_wait_s=10))),
        world=world,
    )
    warm(router, 0.02, per_running_s=0.03)  # 20 ms idle, 30 ms more per request running
    now = router.clock()
    names = [r.replica.name for r in router.replicas.records()]
    for name in names:
        for _ in range(4):  # 140 ms predicted everywhere: over the 100 ms objective
            router.replicas.begin(name, now)
    task = asyncio.create_task(router.route(headers(100), chat_body("hi")))
    queue = router.queue
    assert queue is not None
    await world.advance()
    assert queue.waiting(1) == 1
    await world.advance(0.2)  # the pump looks every 50 ms: still held
    assert not task.done()
    for name in names:
        for _ in range(3):
            router.replicas.end(name, world.monotonic(), 0, 0)
    queue.wake()
    await world.advance()
    routed = await asyncio.wait_for(task, 5)
    assert routed.refusal is None and routed.decision.replica is not None
    assert not routed.decision.objective_missed
    assert routed.arrived_at is not None and routed.arrived_at < routed.decided_at
    assert metric_value(router.metrics.queue_outcomes.labels("default", "dispatched")) == 1
    await queue.close()


async def test_a_held_request_past_its_limit_is_refused_and_an_idle_fleet_holds_nobody() -> None:
    world = ManualWorld()
    router = Router(
        scores_config(queueing=QueueSettings(enabled=True, default=QueueClass(on_miss="queue", max_wait_s=0.2))),
        world=world,
    )
    warm(router, 0.5)
    # Nothing in flight: waiting cannot bring 100 ms closer, so it goes best effort.
    routed = await router.route(headers(100, session="idle"), chat_body("hi"))
    assert routed.refusal is None and routed.decision.objective_missed
    # That request is in flight now: the next one waits, and is refused at its limit.
    held = asyncio.create_task(router.route(headers(100, session="late"), chat_body("hi")))
    await world.advance(0.19)
    assert not held.done()
    await world.advance(0.02)
    late = await asyncio.wait_for(held, 5)
    assert late.refusal is not None and late.refusal.kind == "objective_timeout"
    assert shed_count(router, "objective_timeout") == 1
    assert router.queue is not None
    await router.queue.close()


async def test_attainment_is_judged_on_the_first_token_and_the_tpot_between_first_and_last_tokens() -> None:
    clock = Clock()
    router = Router(scores_config(), clock=clock)
    met = router.metrics.objective_requests

    async def one(session: str, ttft_s: float, stream_s: float, status: int = 200, tokens: int = 11) -> None:
        h = {**headers(100, session=session), "x-slo-tpot-ms": "50"}
        # max_tokens is never the count: the stream reports the tokens it generated.
        routed = await router.route(h, chat_body("hi", max_tokens=500, stream=True), timed=True)
        clock.now += 0.005  # vLLM's headers: at once, whatever the queue
        router.outcomes.observe_response(routed, status, timed=True)
        clock.now += ttft_s
        first = clock.now
        router.outcomes.first_token(routed, first)
        clock.now += stream_s
        router.outcomes.tokens_over(routed, first, clock.now, tokens)
        router.release(routed)

    await one("a", 0.05, 0.4)  # 55 ms, 40 ms a token: met
    await one("b", 0.2, 0.1)  # first token late (its headers were not)
    await one("c", 0.05, 0.8)  # tokens 80 ms apart
    await one("d", 0.05, 0.1, status=503)
    await one("g", 0.05, 0.4, tokens=5)  # stopped early: 100 ms a token
    assert metric_value(met.labels("default", "met")) == 1
    assert metric_value(met.labels("default", "missed")) == 4
    # Without objectives, never answered, or a stream whose first token never came: not judged.
    routed = await router.route(headers(None, session="e"), chat_body("hi"))
    router.outcomes.observe_response(routed, 200)
    router.release(routed)
    unanswered = await router.route(headers(100, session="f"), chat_body("hi"))
    router.release(unanswered)
    tokenless = await router.route(headers(100, session="h"), chat_body("hi", stream=True), timed=True)
    router.outcomes.observe_response(tokenless, 200, timed=True)
    router.release(tokenless)
    assert metric_value(met.labels("default", "met")) + metric_value(met.labels("default", "missed")) == 5


async def test_explain_shows_each_candidates_predictions_the_objective_and_why() -> None:
    router = router_with(default=QueueClass(on_miss="shed"))
    warm(router, 0.5)
    reply = explanation_message(await router.explain(headers(100), chat_body("hi")))
    assert reply.objective_ttft_ms == 100 and reply.objective_tpot_ms == 0
    assert reply.objective_predicted == "missed" and reply.on_miss == "shed"
    assert "every candidate is predicted to miss" in reply.objective_why and "of 100" in reply.objective_why
    assert all(abs(r.predicted_ttft_ms - 500) < 25 for r in reply.replicas)
    assert all(r.predicted_tpot_ms == -1 for r in reply.replicas)  # no TPOT model warm
    shown = render("explain", reply)
    assert "objectives TTFT 100 ms: predicted missed, on_miss shed" in shown and "TTFT/TPOT MS" in shown
    met = explanation_message(await router.explain(headers(1000), chat_body("hi")))
    assert met.objective_predicted == "met" and met.on_miss == "" and "predicted to meet" in met.objective_why
    none = explanation_message(await router.explain(headers(None), chat_body("hi")))
    assert none.objective_predicted == "" and none.objective_why == ""


def test_prediction_errors_are_gauged_per_replica_at_scrape_time() -> None:
    router = Router(scores_config(), clock=Clock())
    names = [r.replica.name for r in router.replicas.records()]
    for i in range(router.latency.warm_after + 40):
        # r0 is always 100 ms; r1 alternates, so its errors spread.
        router.latency.observe_ttft(names[0], LoadPoint(0, 0, 0, 0), 0.1)
        router.latency.observe_ttft(names[1], LoadPoint(0, 0, 0, 0), 0.1 if i % 2 else 0.3)
    gauge = router.metrics.latency_prediction_error
    collect(router)
    p50 = metric_value(gauge.labels(names[1], "ttft", "0.5"))
    p90 = metric_value(gauge.labels(names[1], "ttft", "0.9"))
    expected = router.latency.error_quantiles(names[1])["ttft"]
    assert (p50, p90) == expected and 0 < p50 <= p90
    assert metric_value(gauge.labels(names[0], "ttft", "0.9")) < 0.01
    assert ("tpot" not in router.latency.error_quantiles(names[1])) and names[2] not in {
        s.labels["replica"] for m in gauge.collect() for s in m.samples
    }
