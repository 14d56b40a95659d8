"""Token budgets: admission against the weighted tokens charged, the reservation that bounds a
burst, OpenAI's headers, one budget across two gateways on a real Redis, and a Redis outage
degrading to each gateway's own counts."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from extproc.budgets import BudgetLedger, BudgetSettings, TokenBudget, TokenWeights
from extproc.state.redis_budgets import RedisBudgetStore
from extproc.usage import Usage
from extproc_lab.demo.redis_server import LocalRedis

NOW = 1_000_000.0 * 60  # the start of a minute (and of nothing else in particular)


def _ledger(per_minute: float = 1000, per_day: float | None = None, store: object = None) -> BudgetLedger:
    budget = TokenBudget(per_minute=per_minute, per_day=per_day)
    settings = BudgetSettings(enabled=True, tenants={"acme": budget}, weights=TokenWeights())
    return BudgetLedger(settings, store)  # type: ignore[arg-type]


def test_cached_tokens_count_for_their_weight() -> None:
    weights = TokenWeights(input=1.0, cached_input=0.25, output=2.0)
    assert weights.total(Usage(input=100, cached_input=80, output=10)) == 20 + 20 + 20


async def test_a_tenant_over_its_minute_is_refused_until_the_window_resets() -> None:
    ledger = _ledger(per_minute=1000)
    first = await ledger.admit("acme", 100, NOW)
    assert first.admitted and first.limit == 1000 and first.remaining == 900
    await ledger.settle(first, Usage(input=100, output=850), NOW + 1)
    refused = await ledger.admit("acme", 100, NOW + 2)
    assert not refused.admitted and refused.reset_s == pytest.approx(58)
    assert refused.headers() == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "50",
        "x-ratelimit-reset-tokens": "58s",
        "retry-after": "58",
    }
    assert (await ledger.admit("acme", 100, NOW + 60)).admitted  # a new minute
    assert (await ledger.admit("other", 10**9, NOW)).admitted  # no budget, no limit


async def test_requests_in_flight_reserve_their_estimate_so_a_burst_stops_at_the_limit() -> None:
    ledger = _ledger(per_minute=1000)
    burst = [await ledger.admit("acme", 300, NOW) for _ in range(5)]
    assert [a.admitted for a in burst] == [True, True, True, False, False]
    for admission in burst[:3]:
        ledger.release(admission)  # ended without usage (a reset stream)
    assert ledger.reserved == {}


async def test_the_day_limit_binds_when_it_is_the_tighter() -> None:
    ledger = _ledger(per_minute=1000, per_day=1500)
    for minute in range(2):
        admitted = await ledger.admit("acme", 10, NOW + 60 * minute)
        await ledger.settle(admitted, Usage(input=700), NOW + 60 * minute)
    refused = await ledger.admit("acme", 200, NOW + 120)
    assert not refused.admitted and refused.limit == 1500


async def test_two_gateways_on_one_redis_enforce_one_budget(redis_server: LocalRedis) -> None:
    namespace = uuid.uuid4().hex
    clients = [aioredis.from_url(redis_server.url) for _ in range(2)]
    gateways = [_ledger(per_minute=10_000, store=RedisBudgetStore(c, namespace)) for c in clients]
    try:
        admitted = 0

        async def one(ledger: BudgetLedger) -> None:
            nonlocal admitted
            admission = await ledger.admit("acme", 100, NOW)
            if admission.admitted:
                admitted += 1
                await ledger.settle(admission, Usage(input=100, output=400), NOW)

        # A concurrent burst from both gateways: 500 weighted tokens a request, 10,000 a minute.
        for _ in range(5):
            await asyncio.gather(*(one(g) for g in gateways for _ in range(8)))
        (used,) = await gateways[0].store.used(["acme"], NOW)
        assert used["minute"] == admitted * 500
        # Each gateway admits at most what it has in flight beyond the limit: 8 at a time each.
        assert 10_000 <= used["minute"] <= 10_000 + 2 * 8 * 500
        assert not (await gateways[1].admit("acme", 1, NOW)).admitted  # one budget, seen by both
        assert (await gateways[1].admit("acme", 1, NOW + 60)).admitted
    finally:
        for c in clients:
            await c.aclose()


async def test_a_redis_outage_degrades_to_this_gateways_own_counts() -> None:
    client = aioredis.from_url("redis://127.0.0.1:9", socket_connect_timeout=0.2)  # nothing listens
    ledger = _ledger(per_minute=1000, store=RedisBudgetStore(client))
    try:
        first = await ledger.admit("acme", 100, NOW)
        assert first.admitted  # not refused for an unreachable store ...
        await ledger.settle(first, Usage(input=100, output=900), NOW)
        assert not (await ledger.admit("acme", 100, NOW)).admitted  # ... and not unlimited either
        assert ledger.store_failures >= 2
    finally:
        await client.aclose()
