"""Health stays its own signal: a replica that misses requests' latency objectives (their
attainment, the shedding they cause) is not made unhealthy by that."""

from __future__ import annotations

from extproc.app.router import Router
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.fleet.queueing import QueueClass, QueueSettings
from tests.conftest import chat_body, make_config
from tests.helpers import CHAT, Clock, metric_value


async def serve(objective_ms: str | None, requests: int = 150) -> Router:
    """``requests`` answered 400 ms after their decision (each alone), by a router whose class
    sheds on a predicted miss; with ``objective_ms`` each asks its first token within that."""
    clock = Clock()
    router = Router(make_config(queueing=QueueSettings(default=QueueClass(on_miss="shed"))), clock=clock)
    for i in range(requests):
        h = {":path": CHAT, "x-session-id": f"s{i}"}
        if objective_ms is not None:
            h["x-slo-ttft-ms"] = objective_ms
        routed = await router.route(h, chat_body(f"hello {i}", max_tokens=4))
        if routed.refusal is None:
            clock.now += 0.4
            router.outcomes.observe_response(routed, 200, timed=True)
            router.outcomes.tokens_over(routed, None, None, 1)  # one token: its first came with the answer
            clock.now += 0.03
            router.release(routed)
        clock.now += 0.5
        if i % 10 == 9:
            for rec in router.replicas.records():
                router.replicas.apply_scrape(rec.replica.name, ReplicaMetrics(running=0, waiting=0), clock.now)
            router.replicas.evaluate(clock.now)
    return router


def health(router: Router) -> dict[str, tuple[float, bool]]:
    return {r.replica.name: (r.health, r.rotation.in_rotation) for r in router.replicas.records()}


async def test_a_replica_missing_every_objective_is_as_healthy_as_one_asked_for_none() -> None:
    missing = await serve("100")
    plain = await serve(None)
    judged = missing.metrics.objective_requests
    assert metric_value(judged.labels("default", "missed")) > 0  # it did miss, and the models learnt it
    assert metric_value(missing.metrics.requests_shed.labels("default", "objective")) > 0  # and shed for it
    assert health(missing) == health(plain)
    assert all(in_rotation and score > 0.9 for score, in_rotation in health(missing).values())
