"""Each model's answer length, learned from what the engines reported (output_lengths.py)."""

from __future__ import annotations

import pytest

from extproc.app.router import Router
from extproc.fleet.health.output_lengths import OutputLengths
from extproc.routing.model import Replica
from tests.conftest import chat_body, make_config
from tests.helpers import Clock


def test_a_models_mean_is_given_once_enough_answers_were_seen() -> None:
    book = OutputLengths(min_samples=3)
    book.observe("m", 100, None)
    book.observe("m", 200, 4096)
    assert "m" not in book.view()  # two answers say little yet
    book.observe("m", 300, None)
    assert book.view()["m"] == pytest.approx((100 * 0.98**2 + 200 * 0.98 + 300) / (0.98**2 + 0.98 + 1))
    assert "other" not in book.view()


def test_an_answer_cut_at_its_cap_or_empty_teaches_nothing() -> None:
    book = OutputLengths(min_samples=1)
    book.observe("m", 16, 16)  # stopped at max_tokens: its natural length is unknown
    book.observe("m", 0, None)
    assert book.view() == {}
    book.observe("m", 15, 16)
    assert book.view() == {"m": 15.0}


def test_client_named_models_are_bounded() -> None:
    book = OutputLengths(min_samples=1, max_models=2)
    for name in ("a", "b", "c"):
        book.observe(name, 10, None)
    assert set(book.view()) == {"b", "c"}  # the least recently answered went first
    book.observe("b", 10, None)
    book.observe("d", 10, None)
    assert set(book.view()) == {"b", "d"}
    with pytest.raises(ValueError):
        OutputLengths(max_models=0)


async def test_the_router_learns_them_from_timed_answers_and_the_decision_reads_them() -> None:
    clock = Clock(10.0)
    router = Router(make_config(replicas=(Replica("r0", "127.0.0.1:1"),)), clock=clock)
    for i in range(10):
        # Eight answers of 30 tokens without a cap; two cut at their max_tokens of 500 (left out).
        capped = i >= 8
        body = chat_body(f"prompt {i}", stream=True, **({"max_tokens": 500} if capped else {}))
        routed = await router.route({":path": "/v1/chat/completions"}, body, timed=True)
        router.outcomes.observe_response(routed, 200, timed=True)
        clock.now += 0.05
        router.outcomes.first_token(routed, clock.now)
        clock.now += 0.1
        router.outcomes.tokens_over(routed, clock.now - 0.1, clock.now, 500 if capped else 30)
        router.release(routed)
    given, _ = router.core.inputs(routed.features, await router.store.peek(None, (), clock.now), clock.now)
    assert given.latency is not None and given.latency.output_tokens == {"m": pytest.approx(30.0)}
