"""The fair queue alone: priorities, round robin by tenant, limits, departures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from extproc.adapters.cli import main
from extproc.adapters.envoy_config import GatewaySpec, render_yaml
from extproc.base.world import ManualWorld
from extproc.config import config_from_mapping
from extproc.fleet.queueing import Admission, FairQueue, QueueClass, QueueSettings, Refusal, Ticket, Waiter, saturated
from extproc.routing.model import Replica, ReplicaState, Snapshot

SETTINGS = QueueSettings(
    enabled=True,
    default=QueueClass(priority=1, max_wait_s=5),
    classes={"batch": QueueClass(priority=0, max_wait_s=5, max_queued=50, status=503, retry_after_s=7)},
)


class Fleet:
    """A switchable saturation and a record of the order requests were released in."""

    def __init__(self) -> None:
        self.full = True
        self.order: list[str] = []

    def __call__(self, pool: object) -> bool:
        return self.full


async def _request(queue: FairQueue, fleet: Fleet, name: str, cls: str, tenant: str) -> Refusal | Ticket | None:
    held = await queue.admit(cls, tenant, ())
    if not isinstance(held, Refusal):
        fleet.order.append(name)
    if isinstance(held, Ticket):
        held.settle()
    return held


async def test_interactive_goes_before_every_queued_batch_and_tenants_take_turns() -> None:
    fleet = Fleet()
    world = ManualWorld()
    queue = FairQueue(SETTINGS, fleet, world=world)
    tasks = [asyncio.create_task(_request(queue, fleet, f"a{i}", "batch", "a")) for i in range(6)]
    tasks += [asyncio.create_task(_request(queue, fleet, f"b{i}", "batch", "b")) for i in range(3)]
    await world.advance(1.0)  # a second of a saturated fleet: the pump looks again and again
    tasks += [asyncio.create_task(_request(queue, fleet, f"i{i}", "default", "c")) for i in range(3)]
    await world.advance()
    assert queue.waiting(0) == 9 and queue.waiting(1) == 3 and fleet.order == []
    fleet.full = False
    queue.wake()
    await world.advance()
    await asyncio.gather(*tasks)
    assert fleet.order[:3] == ["i0", "i1", "i2"]
    assert fleet.order[3:9] == ["a0", "b0", "a1", "b1", "a2", "b2"]  # round robin while both wait
    assert fleet.order[9:] == ["a3", "a4", "a5"]
    await queue.close()


async def test_with_headroom_and_nobody_ahead_a_request_goes_straight_on() -> None:
    fleet = Fleet()
    fleet.full = False
    queue = FairQueue(SETTINGS, fleet)
    assert await queue.admit("batch", "t", ()) is None


async def test_past_the_limit_a_request_is_refused_and_leaves() -> None:
    fleet = Fleet()
    settings = QueueSettings(
        enabled=True, classes={"batch": QueueClass(priority=0, max_wait_s=0.1, max_queued=2, status=503)}
    )
    world = ManualWorld()
    queue = FairQueue(settings, fleet, world=world)
    waiting = [asyncio.create_task(queue.admit("batch", "t", ())) for _ in range(2)]
    await world.advance()
    full = await queue.admit("batch", "t", ())
    assert isinstance(full, Refusal) and full.kind == "queue_full" and full.status == 503
    await world.advance(0.09)
    assert not any(w.done() for w in waiting)  # within their 0.1 s
    await world.advance(0.02)
    assert all(w.done() for w in waiting)
    timed_out = await asyncio.gather(*waiting)
    assert all(isinstance(r, Refusal) and r.kind == "queue_timeout" for r in timed_out)
    assert len(queue) == 0
    await queue.close()


async def test_a_cancelled_waiter_frees_its_place() -> None:
    fleet = Fleet()
    world = ManualWorld()
    queue = FairQueue(SETTINGS, fleet, world=world)
    task = asyncio.create_task(queue.admit("batch", "t", ()))
    await world.advance()
    assert len(queue) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(queue) == 0
    await queue.close()


def test_the_core_expires_every_waiter_past_its_limit_and_tenants_keep_their_turn() -> None:
    now = [0.0]
    fleet = Fleet()
    settings = QueueSettings(
        enabled=True,
        classes={
            "batch": QueueClass(priority=0, max_wait_s=5.0, max_queued=4),
            "bulk": QueueClass(priority=0, max_wait_s=1.0),
        },
    )
    core: Admission[str] = Admission(settings, fleet, lambda: now[0])
    for name, cls, tenant in (("a0", "bulk", "a"), ("a1", "batch", "a"), ("b0", "batch", "b")):
        assert isinstance(core.admit(cls, tenant, (), name), Waiter)
    now[0] = 0.5
    assert isinstance(core.admit("bulk", "a", (), "a2"), Waiter)
    full = core.admit("batch", "c", (), "c0")
    assert isinstance(full, Refusal) and full.kind == "queue_full"
    assert core.next_to_go() is None and core.next_deadline() == 1.0  # saturated: the head waits
    now[0] = 1.0
    expired = core.expire()
    assert [(w.item, r.kind, r.message) for w, r in expired] == [
        ("a0", "queue_timeout", "every replica stayed saturated for 1 s")
    ]
    now[0] = 1.5
    assert [w.item for w, _ in core.expire()] == ["a2"]  # behind a1 in its line: it expires all the same
    fleet.full = False
    # Tenant a lost its waiters, not its turn: a1 goes first, then b0.
    assert [w.item for w in iter(core.next_to_go, None)] == ["a1", "b0"]
    assert len(core) == 0 and core.next_deadline() is None


def test_a_request_held_for_its_objective_waits_on_an_idle_fleet_until_it_is_ready() -> None:
    now = [0.0]
    fleet = Fleet()
    fleet.full = False
    core: Admission[str] = Admission(SETTINGS, fleet, lambda: now[0])
    ready = [False]
    held = core.admit("default", "a", (), "slo", lambda: ready[0])
    assert isinstance(held, Waiter) and held.ready is not None
    # Nothing is saturated, yet it waits; and it holds back what comes behind at its priority.
    assert core.next_to_go() is None
    assert isinstance(core.admit("default", "b", (), "next"), Waiter)
    assert core.admit("batch", "c", (), "batch") is not None
    ready[0] = True
    assert [w.item for w in iter(core.next_to_go, None)] == ["slo", "next", "batch"]
    # One that never becomes ready leaves at its class's limit, refused for its objective.
    assert isinstance(core.admit("default", "a", (), "late", lambda: False), Waiter)
    now[0] = 5.0
    [(waiter, refusal)] = core.expire()
    assert waiter.item == "late" and refusal.kind == "objective_timeout" and refusal.status == 429
    assert "latency objectives within 5 s" in refusal.message


def test_queue_on_miss_needs_the_queue_on() -> None:
    with pytest.raises(ValueError, match="on_miss is queue"):
        config_from_mapping({"queueing": {"classes": {"chat": {"on_miss": "queue"}}}})
    assert (
        config_from_mapping({"queueing": {"classes": {"chat": {"on_miss": "shed"}}}}).queueing.for_class("chat").on_miss
        == "shed"
    )


def test_saturation_is_every_candidate_of_the_pool() -> None:
    settings = QueueSettings(enabled=True, max_inflight_per_replica=2)
    a = ReplicaState(Replica("a", "h:1", labels={"pool": "x"}), kv_usage=0.95)
    b = ReplicaState(Replica("b", "h:2", labels={"pool": "y"}), queue=3)
    snap = Snapshot((a, b))
    assert saturated(snap, (("pool", "x"),), settings)
    assert not saturated(snap, (("pool", "y"),), settings)
    assert not saturated(snap, (), settings)
    busy = Snapshot((a, ReplicaState(b.replica, inflight=2)))
    assert saturated(busy, (), settings)
    assert not saturated(Snapshot(()), (), settings)
    # Sent since the last scrape (in flight beyond what it was running): queued there by now.
    fresh = QueueSettings(enabled=True, queue_threshold=4)
    assert saturated(Snapshot((ReplicaState(b.replica, inflight=9, running=4),)), (), fresh)
    assert not saturated(Snapshot((ReplicaState(b.replica, inflight=8, running=4),)), (), fresh)


def test_envoy_waits_longer_than_the_longest_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queueing = {"enabled": True, "classes": {"batch": {"priority": 0, "max_wait_s": 45}}}
    cfg = config_from_mapping({"queueing": queueing})
    assert cfg.queueing.longest_wait_s == 45
    assert config_from_mapping({"queueing": {**queueing, "enabled": False}}).queueing.longest_wait_s == 0
    # A request held for KV room waits that too, before or after the fair queue.
    room = {**queueing, "kv_room": True, "kv_room_max_wait_s": 4}
    assert config_from_mapping({"queueing": room}).queueing.longest_wait_s == 49
    assert config_from_mapping({"queueing": {**room, "enabled": False}}).queueing.longest_wait_s == 4
    rendered = render_yaml(GatewaySpec(replicas=[Replica("r", "127.0.0.1:1")], queue_wait_s=45))
    assert "message_timeout: 46s" in rendered, rendered
    # `extproc envoy-config --config` takes it from the router's config: message and route timeouts.
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "a", "address": "10.0.0.1:8000"}], "queueing": queueing}))
    assert main(["envoy-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "message_timeout: 46s" in out and "timeout: 345s" in out
