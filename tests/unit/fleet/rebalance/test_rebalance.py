"""Rebalancing: the ledger, the planner, pre-warming, and the router moving sessions."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from extproc.app.router import Router
from extproc.fleet.health.replicas import LoadReport
from extproc.fleet.rebalance import (
    LedgerEntry,
    Prewarm,
    Prewarmer,
    PrewarmQueue,
    PrewarmSettings,
    SessionLedger,
    plan_join,
    plan_leave,
    plan_shed,
    prefill_only,
)
from extproc.routing import HashRing, Replica, ReplicaState
from tests.conftest import chat_body, make_config
from tests.helpers import metric_value


def entries(n: int, replicas: list[str]) -> list[LedgerEntry]:
    ring = HashRing([(r, 1.0) for r in replicas])
    return [
        LedgerEntry(f"s{i}", "m", ring.preference(f"s{i}", 1)[0], "/v1/chat/completions", b"{}", 0.0) for i in range(n)
    ]


def states(names: list[str], **kw: dict[str, object]) -> list[ReplicaState]:
    return [ReplicaState(Replica(n, f"10.0.0.{i}:80"), **kw.get(n, {})) for i, n in enumerate(names)]  # type: ignore[arg-type]


def test_ledger_is_bounded_by_count_and_bytes() -> None:
    ledger = SessionLedger(max_sessions=3, max_bytes=1000)
    for i in range(5):
        ledger.note(f"s{i}", "m", "r", "/p", b"x" * 100, now=i)
    assert len(ledger) == 3 and [e.session for e in ledger.live(5)] == ["s2", "s3", "s4"]
    ledger.note("big", "m", "r", "/p", b"x" * 900, now=6)
    assert ledger.size_bytes <= 1000 and [e.session for e in ledger.live(6)][-1] == "big"
    assert list(ledger.live(10_000)) == []  # past the TTL nothing is live


def test_a_join_moves_about_its_share_and_only_to_the_newcomer() -> None:
    old = [f"r{i}" for i in range(8)]
    sessions = entries(4000, old)
    ring = HashRing([(r, 1.0) for r in [*old, "new"]])
    moves = plan_join("new", sessions, ring, now=0.0, session_cooldown_s=300)
    assert 0.08 < len(moves) / len(sessions) < 0.15  # ideal 1/9 = 0.111
    assert {m.target for m in moves} == {"new"}
    assert len(Counter(m.source for m in moves)) == 8  # taken from every replica, not one


def test_a_leave_moves_every_session_within_the_bound() -> None:
    names = [f"r{i}" for i in range(5)]
    sessions = entries(1000, names)
    ring = HashRing([(r, 1.0) for r in names])
    st = states(names)
    moves = plan_leave("r0", sessions, ring, st)
    leaving = [e for e in sessions if e.replica == "r0"]
    assert len(moves) == len(leaving) and all(m.target != "r0" for m in moves)
    per_target = Counter(m.target for m in moves)
    assert max(per_target.values()) <= 1.25 * len(leaving) / 4 + 2
    out = states(names, r1={"in_rotation": False})
    assert all(m.target != "r1" for m in plan_leave("r0", sessions, ring, out))


def test_shedding_respects_fraction_and_session_cooldown() -> None:
    names = ["hot", "a", "b"]
    sessions = [LedgerEntry(f"s{i}", "m", "hot", "/p", b"{}", float(i)) for i in range(50)]
    moves = plan_shed("hot", sessions, states(names), 0.1, now=100.0, session_cooldown_s=300)
    assert len(moves) == 5 and {m.session for m in moves} == {f"s{i}" for i in range(45, 50)}
    for e in sessions:
        e.moved_at = 90.0
    assert plan_shed("hot", sessions, states(names), 0.1, now=100.0, session_cooldown_s=300) == []


def test_prefill_only_asks_for_one_token_without_streaming() -> None:
    body = prefill_only(chat_body("hi", stream=True, stream_options={"include_usage": True}, max_tokens=500))
    assert body is not None
    request = json.loads(body)
    assert request["max_tokens"] == 1 and "stream" not in request and "stream_options" not in request
    assert prefill_only(b"not json") is None


async def test_prewarmer_sends_at_its_rate_and_drops_the_oldest_when_full() -> None:
    sent: list[str] = []
    outcomes: list[str] = []

    async def send(address: str, path: str, body: bytes, timeout_s: float) -> int:
        sent.append(address)
        return 200

    loop = asyncio.get_running_loop()
    settings = PrewarmSettings(enabled=True, rate_per_s=200.0, burst=2, queue=3)
    warm = Prewarmer(settings, loop.time, send=send, on_result=outcomes.append)
    for i in range(5):
        warm.submit(f"h{i}:1", "/v1/chat/completions", chat_body("x"))
    await warm.drain()
    assert sent == ["h2:1", "h3:1", "h4:1"] and outcomes.count("dropped") == 2 and outcomes.count("ok") == 3
    assert not Prewarmer(PrewarmSettings(enabled=False), loop.time, send=send).submit("h:1", "/p", b"{}")


def test_the_prewarm_queue_lets_one_go_per_token_on_any_clock() -> None:
    now = [0.0]
    outcomes: list[str] = []
    queue = PrewarmQueue(
        PrewarmSettings(enabled=True, rate_per_s=2.0, burst=1, queue=2), lambda: now[0], outcomes.append
    )
    assert queue.take() is None
    for i in range(3):
        assert queue.submit(f"h{i}:1", "/v1/chat/completions", chat_body("x"))
    assert outcomes == ["dropped"] and len(queue) == 2
    first = queue.take()
    assert isinstance(first, Prewarm) and first.address == "h1:1"
    assert queue.take() == pytest.approx(0.5)  # the bucket is empty: a token every half second
    now[0] = 0.5
    second = queue.take()
    assert isinstance(second, Prewarm) and second.address == "h2:1" and queue.take() is None
    queue.sent(200)
    queue.sent(503)
    queue.sent(None)
    assert outcomes == ["dropped", "ok", "error", "error"]
    assert not queue.submit("h:1", "/p", b"not json") and outcomes[-1] == "unusable"


async def test_router_moves_and_prewarms_on_join_leave_and_heat() -> None:
    router = Router(make_config(replicas=tuple(Replica(f"r{i}", f"10.0.0.{i}:80") for i in range(4))))
    sent: list[str] = []

    async def send(address: str, path: str, body: bytes, timeout_s: float) -> int:
        sent.append(address)
        return 200

    router.rebalancer.settings = router.rebalancer.settings.model_copy(update={"move_on_join": True})
    router.rebalancer.prewarmer.send = send
    router.rebalancer.prewarmer.queue.settings = PrewarmSettings(
        enabled=True, rate_per_s=10_000, burst=10_000, queue=10_000
    )
    headers = {":path": "/v1/chat/completions"}
    for i in range(400):
        routed = await router.route({**headers, "x-session-id": f"s{i}"}, chat_body(f"conversation {i} " * 20))
        router.release(routed)
    before = Counter(e.replica for e in router.rebalancer.ledger.live(router.clock()))
    assert sum(before.values()) == 400

    await router.fleet.set_replicas([*router.config.replicas, Replica("r9", "10.0.0.9:80")])
    await router.rebalancer.prewarmer.drain()
    moved = metric_value(router.metrics.sessions_moved.labels("join"))
    assert 20 < moved < 140 and sent.count("10.0.0.9:80") == moved
    some = next(e for e in router.rebalancer.ledger.live(router.clock()) if e.replica == "r9")
    view = await router.store.lookup(some.session, (), router.clock(), model="m")
    assert view.pinned == "r9"  # the store agrees: the next turn goes to the pre-warmed replica

    on_r1 = sum(1 for e in router.rebalancer.ledger.live(router.clock()) if e.replica == "r1")
    await router.fleet.set_replicas(
        [r for r in [*router.config.replicas, Replica("r9", "10.0.0.9:80")] if r.name != "r1"]
    )
    assert metric_value(router.metrics.sessions_moved.labels("leave")) == on_r1
    assert not any(e.replica == "r1" for e in router.rebalancer.ledger.live(router.clock()))


async def test_a_replica_hot_for_long_enough_sheds_once_per_cooldown() -> None:
    clock = [1000.0]
    router = Router(make_config(), clock=lambda: clock[0])
    router.rebalancer.prewarmer.queue.settings = PrewarmSettings(enabled=False)
    for i in range(60):
        await router.route({":path": "/v1/chat/completions", "x-session-id": f"s{i}"}, chat_body(f"c{i} " * 30))
    hot = Counter(e.replica for e in router.rebalancer.ledger.live(clock[0])).most_common(1)[0][0]
    router.replicas.apply_report(hot, LoadReport(queue=2, running=10, kv_usage=0.97))
    await router.fleet.after_scrape([])
    assert metric_value(router.metrics.sessions_moved.labels("hot")) == 0  # not hot for long yet
    clock[0] += 11
    await router.fleet.after_scrape([])
    shed = metric_value(router.metrics.sessions_moved.labels("hot"))
    assert shed >= 1
    clock[0] += 5
    await router.fleet.after_scrape([])
    assert metric_value(router.metrics.sessions_moved.labels("hot")) == shed  # replica cooldown


@pytest.mark.parametrize("bad", [{"rebalance": {"shed_fraction": 2}}, {"rebalance": {"prewarm": {"rate_per_s": 0}}}])
def test_rebalance_config_errors_name_the_field(bad: dict[str, object]) -> None:
    from extproc.config import ConfigError, config_from_mapping

    with pytest.raises(ConfigError, match="rebalance"):
        config_from_mapping(bad)
