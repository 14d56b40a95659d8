"""Each replica's engine speeds: a prior per pool (``health.engine_rates``), then its cold prefill
rate and decode step learnt from answers it served alone, and nothing from answers under load."""

from __future__ import annotations

import random

import pytest

from extproc.app.router import Router
from extproc.config import ConfigError, config_from_mapping
from extproc.fleet.health.rates import RateBook
from extproc.fleet.health.settings import RatePrior
from extproc.routing.latency import LoadPoint
from extproc.routing.model import Replica
from tests.conftest import chat_body, make_config
from tests.helpers import Clock

GPU = {"pool": "h100"}


def test_each_pool_starts_from_its_own_prior_the_first_that_matches() -> None:
    cfg = config_from_mapping(
        {
            "health": {
                "engine_rates": [
                    {"labels": GPU, "prefill_tokens_per_s": 20000.0, "decode_step_s": 0.01},
                    {"prefill_tokens_per_s": 3000.0, "decode_step_s": 0.05, "overhead_s": 0.01},
                ]
            }
        }
    )
    book = RateBook([p.pool() for p in cfg.health.engine_rates])
    assert book.rates("a", GPU).prefill_tokens_per_s == 20000.0
    cpu = book.rates("b", {"pool": "cpu"})
    assert (cpu.prefill_tokens_per_s, cpu.decode_step_s, cpu.overhead_s) == (3000.0, 0.05, 0.01)
    assert RateBook().rates("c", {}) == RateBook([RatePrior().pool()]).rates("c", {})  # the built-in prior
    # The price reads the same priors, through the latency view the router gives each decision.
    router = Router(cfg)
    assert router.latency.view().priors == book.priors
    with pytest.raises(ConfigError, match="prefill_tokens_per_s"):
        config_from_mapping({"health": {"engine_rates": [{"prefill_tokens_per_s": 0}]}})


def test_the_cold_prefill_rate_and_overhead_are_learnt_from_requests_served_alone() -> None:
    book = RateBook([RatePrior(prefill_tokens_per_s=20000.0, overhead_s=0.0).pool()])
    rng = random.Random(3)
    for _ in range(200):
        tokens = rng.uniform(200, 3000)
        # 40 ms of overhead and 5,000 tokens a second, with 5% noise.
        seconds = (0.04 + tokens / 5000.0) * rng.uniform(0.95, 1.05)
        book.observe_ttft("r", {}, LoadPoint(tokens, 0, 0, 0.0), seconds)
        # Under load the same prompt takes longer: not the engine alone, not learnt from.
        book.observe_ttft("r", {}, LoadPoint(tokens, 4000, 6, 0.5), seconds * 3)
    rates = book.view()["r"]
    assert rates.prefill_tokens_per_s == pytest.approx(5000.0, rel=0.1)
    assert rates.overhead_s == pytest.approx(0.04, abs=0.015)
    assert rates.prefill_s(1000) == pytest.approx(0.24, rel=0.1)
    assert rates.prefill_samples == 200


def test_prompts_of_one_length_give_no_slope_and_the_decode_step_is_a_mean() -> None:
    book = RateBook([RatePrior(prefill_tokens_per_s=8000.0, decode_step_s=0.02).pool()])
    for _ in range(50):
        book.observe_ttft("r", {}, LoadPoint(1000, 0, 0, 0.0), 0.5)
        book.observe_tpot("r", {}, LoadPoint(1000, 0, 0, 0.0), 0.03)
        book.observe_tpot("r", {}, LoadPoint(1000, 0, 12, 0.0), 0.09)  # in a batch: not alone
    rates = book.view()["r"]
    assert rates.prefill_tokens_per_s == 8000.0  # a line through one length is any line
    assert rates.decode_step_s == pytest.approx(0.03, rel=0.05) and rates.decode_samples == 50


async def test_the_router_learns_them_from_timed_answers_and_shows_the_prior_elsewhere() -> None:
    clock = Clock(10.0)
    fleet = (Replica("r0", "127.0.0.1:1", labels=GPU), Replica("r1", "127.0.0.1:2"))
    from extproc.fleet.health.settings import HealthSettings

    health = HealthSettings(latency_models="always", engine_rates=[RatePrior(labels=GPU, prefill_tokens_per_s=1e5)])
    router = Router(make_config(replicas=fleet, health=health), clock=clock)
    assert router.engine_rates()["r0"].prefill_tokens_per_s == 1e5
    assert router.engine_rates()["r1"].prefill_tokens_per_s == RatePrior().prefill_tokens_per_s
    for i in range(40):
        text = f"prompt {i} " + "word " * (50 + 40 * (i % 10))
        routed = await router.route({":path": "/v1/chat/completions"}, chat_body(text, stream=True), timed=True)
        assert routed.load_point is not None and routed.decision.replica is not None
        clock.now += 0.001
        router.outcomes.observe_response(routed, 200, timed=True)
        clock.now += 0.02 + routed.load_point.uncached_tokens / 4000.0  # 4,000 tokens a second
        first = clock.now
        router.outcomes.first_token(routed, first)
        clock.now += 0.1
        router.outcomes.tokens_over(routed, first, clock.now, 6)
        router.release(routed)
    learnt = router.engine_rates()
    for name in ("r0", "r1"):
        if learnt[name].prefill_samples >= 10:
            assert learnt[name].prefill_tokens_per_s == pytest.approx(4000.0, rel=0.25), learnt
            assert learnt[name].decode_step_s == pytest.approx(0.02, rel=0.3), learnt
    assert sum(r.prefill_samples for r in learnt.values()) == 40
    # The price reads what was learnt through the decision's inputs; no prior passes as learnt.
    given, _ = router.core.inputs(routed.features, await router.store.peek(None, (), clock.now), clock.now)
    for name, r in learnt.items():
        seen = given.latency.rates.get(name) if given.latency is not None else None
        if r.prefill_samples == 0 and r.decode_samples == 0:
            assert seen is None, name
        else:
            assert seen is not None and seen.prefill_tokens_per_s == r.prefill_tokens_per_s, (name, seen)
            assert seen.decode_s_per_token == r.decode_step_s
