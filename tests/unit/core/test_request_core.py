"""The request core driven by hand, as h11's tests drive a connection: its steps are pushed
through in memory, each effect it asks for seen and answered by the test, no store, queue or
event loop behind it."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.app.router import Router
from extproc.core.effects import Effect, Hold, Identify, Lookup, Record, Reserve, Steps, Tokenize, at_once
from extproc.fleet.queueing import QueueSettings, Refusal
from extproc.routing.model import AffinityView, Reason
from extproc.state.budgets import Admission as BudgetAdmission
from extproc.state.budgets import BudgetSettings
from tests.conftest import chat_body, make_config
from tests.helpers import CHAT, Clock


class Pushed:
    """A core step pushed by hand: every effect it asked for, answered by ``answer``."""

    def __init__(self, steps: Steps[Any], answer: Any) -> None:
        self.effects: list[Effect] = []
        result: Any = None
        while True:
            try:
                effect = steps.send(result)
            except StopIteration as stop:
                self.result = stop.value
                return
            self.effects.append(effect)
            result = answer(effect)

    def kinds(self) -> list[type]:
        return [type(e) for e in self.effects]


def plain(effect: Effect) -> Any:
    """The world as a fresh memory store would answer it: nothing known, nothing waited for."""
    if isinstance(effect, Identify | Tokenize):
        return effect.features
    if isinstance(effect, Lookup):
        return AffinityView()
    return None


def test_a_request_asks_for_its_conversation_its_tokens_its_view_then_records_where_it_went() -> None:
    router = Router(make_config(), clock=Clock(5.0))
    pushed = Pushed(router.core.route({":path": CHAT, "x-session-id": "s1"}, chat_body("hello " * 50)), plain)
    assert pushed.kinds() == [Identify, Tokenize, Lookup, Record]
    routed, (_, _, lookup, record) = pushed.result, pushed.effects
    assert isinstance(lookup, Lookup) and lookup.features.session_key == "s1" and not lookup.peek
    assert isinstance(record, Record) and routed.decision.replica is not None
    assert record.replica == routed.decision.replica.name and record.pin and record.now == 5.0


def test_the_stores_view_is_what_the_decision_follows() -> None:
    router = Router(make_config(), clock=Clock(5.0))
    names = [r.replica.name for r in router.replicas.records()]
    for pinned in names:

        def answer(effect: Effect, pinned: str = pinned) -> Any:
            return AffinityView(pinned=pinned) if isinstance(effect, Lookup) else plain(effect)

        routed = Pushed(router.core.route({":path": CHAT, "x-session-id": "s"}, chat_body("hi")), answer).result
        assert routed.decision.replica.name == pinned and routed.decision.reason is Reason.STICKY


def test_a_spent_budget_refuses_before_the_store_is_read() -> None:
    router = Router(make_config(budgets=BudgetSettings(enabled=True)), clock=Clock(5.0))
    spent = BudgetAdmission(admitted=False, limit=10.0, remaining=0.0, reset_s=7.0, refused_by="tenant")

    def answer(effect: Effect) -> Any:
        return spent if isinstance(effect, Reserve) else plain(effect)

    pushed = Pushed(router.core.route({":path": CHAT}, chat_body("hi")), answer)
    assert Reserve in pushed.kinds() and Lookup not in pushed.kinds() and Record not in pushed.kinds()
    refusal = pushed.result.refusal
    assert refusal is not None and (refusal.status, refusal.kind, refusal.retry_after_s) == (429, "tokens_exceeded", 7)
    assert pushed.result.budget is spent  # its x-ratelimit-* headers answer the client


def test_a_full_queue_refuses_and_nothing_is_decided() -> None:
    router = Router(make_config(queueing=QueueSettings(enabled=True)), clock=Clock(5.0))
    full = Refusal(503, 1.0, "the queue is full", "queue_full")

    def answer(effect: Effect) -> Any:
        return full if isinstance(effect, Hold) else plain(effect)

    pushed = Pushed(router.core.route({":path": CHAT}, chat_body("hi")), answer)
    assert pushed.kinds()[-1] is Hold and pushed.result.refusal is full
    assert all(r.inflight == 0 for r in router.replicas.records())


def test_driven_at_once_an_effect_that_would_wait_is_refused() -> None:
    async def answers() -> int:
        return 5

    class Pending:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield  # what a network store does: wait for the event loop

    async def waits() -> None:
        await Pending()

    assert at_once(answers()) == 5
    with pytest.raises(RuntimeError, match="memory store"):
        at_once(waits())


async def test_both_drivers_route_the_same_request_alike() -> None:
    routed = []
    for drive in ("loop", "at_once"):
        router = Router(make_config(), clock=Clock(5.0))
        steps = router.core.route({":path": CHAT, "x-session-id": "s9"}, chat_body("same prompt " * 40))
        routed.append(await router.effects.drive(steps) if drive == "loop" else router.effects.drive_now(steps))
    (a, b) = routed
    assert a.decision.replica == b.decision.replica and a.features.prefix_hashes == b.features.prefix_hashes


def test_the_debug_log_tells_each_candidates_score(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(make_config(), clock=Clock(5.0))
    with caplog.at_level("DEBUG", logger="extproc.app.router"):
        pushed = Pushed(router.core.route({":path": CHAT, "x-session-id": "s1"}, chat_body("hello " * 50)), plain)
    decision = pushed.result.decision
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "decision"]
    scores = record.scores  # type: ignore[attr-defined]
    assert set(scores) == set(decision.scores) and len(scores) > 1
    assert list(scores.values()) == sorted(scores.values(), reverse=True)  # best first
    assert scores[decision.replica.name] == max(scores.values())  # the chosen one among the best
    assert f"{decision.replica.name}:" in record.getMessage().split("scores=")[1]
