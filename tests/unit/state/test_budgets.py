"""Token budgets: admission against the weighted tokens charged, the reservation that bounds a
burst, OpenAI's headers, one budget across two gateways on a real Redis, and a Redis outage
degrading to each gateway's own counts; budgets per API key and per model beside the tenant's,
the tightest deciding, on memory and on Redis."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from extproc.app.plan import Forward, Planner, Refuse
from extproc.app.router import Router
from extproc.config import ConfigError, config_from_mapping
from extproc.request.tenant import api_key_digest
from extproc.request.usage import Usage
from extproc.state.budgets import FREE, BudgetLedger, BudgetSettings, KeyBudget, TokenBudget, TokenWeights, window_start
from extproc.state.redis_budgets import RedisBudgetStore
from extproc.state.redis_client import connect
from extproc.state.store_url import parse_store_url
from extproc_lab.demo.processes import ProcessGroup
from extproc_lab.demo.redis_server import LocalCluster, LocalRedis
from tests.conftest import chat_body, make_config, require_binary

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
        ledger.release(admission)  # never sent (refused after admission, e.g. shed): nothing to charge
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


# --- budgets per API key and per model ----------------------------------------------------------

KEY = "sk-ci-bot-0001"


def _layered(store: object = None) -> BudgetLedger:
    """acme: 10,000 a minute; the CI bot's key: 500; the big model: 2,000 over every tenant."""
    settings = BudgetSettings(
        enabled=True,
        tenants={"acme": TokenBudget(per_minute=10_000)},
        keys={"ci-bot": KeyBudget(per_minute=500, sha256=api_key_digest(KEY))},
        models={"big": TokenBudget(per_minute=2_000)},
    )
    return BudgetLedger(settings, store)  # type: ignore[arg-type]


def test_the_key_is_known_by_its_digest_and_hashed_only_when_a_key_has_a_budget() -> None:
    ledger = _layered()
    assert ledger.key_digest({"authorization": f"Bearer {KEY}"}) == api_key_digest(KEY)
    assert ledger.key_digest({"authorization": "Basic abc"}) is None
    assert _ledger().key_digest({"authorization": f"Bearer {KEY}"}) is None  # no key budgets: no hashing
    assert ledger.subjects("acme", api_key_digest(KEY), "big") == ("acme", "key/ci-bot", "model/big")
    assert ledger.subjects("walk-in", api_key_digest("another key"), "small") == ()


async def test_the_tightest_applying_budget_decides_and_says_whose_it_is() -> None:
    ledger = _layered()
    bot = api_key_digest(KEY)
    first = await ledger.admit("acme", 100, NOW, key_digest=bot, model="big")
    assert first.admitted and first.limit == 500 and first.remaining == 400  # the key's is tightest
    await ledger.settle(first, Usage(input=100, output=380), NOW)
    refused = await ledger.admit("acme", 100, NOW + 1, key_digest=bot, model="big")
    assert not refused.admitted and refused.refused_by == "key" and refused.headers()["retry-after"] == "59"
    # The same tenant with another key still has room: then the model's budget is the tightest.
    other_key = await ledger.admit("acme", 100, NOW + 1, key_digest=api_key_digest("sk-other"), model="big")
    assert other_key.admitted and other_key.limit == 2_000 and other_key.remaining == 2_000 - 480 - 100
    assert other_key.subjects == ("acme", "model/big")
    ledger.release(other_key)
    assert ledger.reserved == {}


async def test_a_model_budget_binds_every_tenant_and_no_other_model() -> None:
    ledger = _layered()
    for tenant in ("t1", "t2"):  # tenants without budgets of their own
        admitted = await ledger.admit(tenant, 10, NOW, model="big")
        assert admitted.subjects == ("model/big",)
        await ledger.settle(admitted, Usage(input=1_000), NOW)
    refused = await ledger.admit("t3", 10, NOW, model="big")
    assert not refused.admitted and refused.refused_by == "model" and refused.limit == 2_000
    assert (await ledger.admit("t3", 10, NOW, model="small")) is FREE


async def test_of_two_windows_out_of_room_the_later_reset_is_the_retry_after() -> None:
    ledger = _ledger(per_minute=1_000, per_day=1_000)
    admitted = await ledger.admit("acme", 10, NOW)
    await ledger.settle(admitted, Usage(input=1_000), NOW)
    refused = await ledger.admit("acme", 10, NOW + 30)
    assert not refused.admitted and refused.reset_s > 60  # the day's end, not the minute's
    assert refused.reset_s == window_start(86_400, NOW) + 86_400 - (NOW + 30)


async def test_standings_list_every_configured_budget_with_what_is_left() -> None:
    ledger = _layered()
    admitted = await ledger.admit("acme", 100, NOW, key_digest=api_key_digest(KEY), model="big")
    await ledger.settle(admitted, Usage(input=100, output=100), NOW)
    held = await ledger.admit("acme", 50, NOW, key_digest=api_key_digest(KEY), model="big")  # in flight
    standings = {(s.kind, s.name): s.windows for s in await ledger.standings(NOW + 10)}
    assert set(standings) == {("tenant", "acme"), ("key", "ci-bot"), ("model", "big")}
    (minute,) = standings[("key", "ci-bot")]
    assert (minute.window, minute.limit, minute.used, minute.remaining) == ("minute", 500, 200, 250)
    assert minute.reset_s == 50
    ledger.release(held)


def test_key_budgets_hold_digests_never_keys() -> None:
    digest = api_key_digest(KEY)
    by_digest = config_from_mapping({"budgets": {"keys": {digest: {"per_minute": 10}}}})
    assert BudgetLedger(by_digest.budgets).subjects("", digest) == (f"key/{digest}",)
    for keys, words in (
        ({"ci-bot": {"per_minute": 10}}, "give sha256"),
        ({"ci-bot": {"per_minute": 10, "sha256": KEY}}, "never the key itself"),
        ({"a": {"sha256": digest}, "b": {"sha256": digest}}, "name one key"),
    ):
        with pytest.raises(ConfigError) as err:
            config_from_mapping({"budgets": {"keys": keys}})
        assert "budgets.keys" in str(err.value) and words in str(err.value)
        assert KEY not in str(err.value) or words == "never the key itself"
    with pytest.raises(ConfigError, match="may not start with"):
        config_from_mapping({"budgets": {"tenants": {"key/x": {"per_minute": 1}}}})


async def test_key_and_model_budgets_are_one_budget_across_gateways_on_redis(redis_server: LocalRedis) -> None:
    namespace = uuid.uuid4().hex
    clients = [aioredis.from_url(redis_server.url) for _ in range(2)]
    a, b = (_layered(RedisBudgetStore(c, namespace)) for c in clients)
    bot = api_key_digest(KEY)
    try:
        first = await a.admit("acme", 100, NOW, key_digest=bot, model="big")
        await a.settle(first, Usage(input=100, output=380), NOW)
        # Gateway b sees gateway a's charge to the key, the tenant and the model alike.
        refused = await b.admit("acme", 100, NOW, key_digest=bot, model="big")
        assert not refused.admitted and refused.refused_by == "key"
        used = await b.store.used(["acme", "key/ci-bot", "model/big", "model/small"], NOW)
        assert [u["minute"] for u in used] == [480, 480, 480, 0]
        # Two tenants on two gateways spend the model's budget together.
        for gateway, tenant in ((a, "t1"), (b, "t2"), (a, "t3")):
            admitted = await gateway.admit(tenant, 10, NOW, model="big")
            assert admitted.admitted, tenant
            await gateway.settle(admitted, Usage(input=500), NOW)
        assert (await b.admit("t4", 10, NOW, model="big")).admitted  # 480 + 1,500 + 10 fits in 2,000
        assert not (await b.admit("t5", 30, NOW, model="big")).admitted  # ... 30 more does not
        assert a.store_failures == b.store_failures == 0
    finally:
        for c in clients:
            await c.aclose()


async def test_a_key_over_its_budget_is_refused_by_the_router_with_the_rate_limit_headers() -> None:
    settings = BudgetSettings(enabled=True, keys={"ci-bot": KeyBudget(per_minute=50, sha256=api_key_digest(KEY))})
    planner = Planner(Router(make_config(budgets=settings)))
    headers = {":path": "/v1/chat/completions", "authorization": f"Bearer {KEY}"}
    plan = await planner.plan(headers, chat_body("hello " * 40))  # about 60 tokens: more than 50
    assert isinstance(plan.action, Refuse) and plan.action.status == 429
    assert plan.action.kind == "tokens_exceeded" and "API key's token budget" in plan.action.message
    extra = dict(plan.action.headers)
    assert extra["x-ratelimit-limit-tokens"] == "50" and int(extra["retry-after"]) >= 1
    assert KEY not in repr(plan) and api_key_digest(KEY) not in repr(plan)
    other = await planner.plan({**headers, "authorization": "Bearer sk-someone-else"}, chat_body("hello " * 40))
    assert isinstance(other.action, Forward)
    planner.end(other)


def _spread_namespace(subjects: tuple[str, ...], shards: int) -> str:
    """A namespace under which each subject's hash slot is on another of ``shards`` even shards."""
    for i in range(10_000):
        namespace = f"spread-{i}"
        nodes = {key_slot(f"budget:{namespace}:{s}".encode()) * shards // 16384 for s in subjects}
        if len(nodes) == len(subjects):
            return namespace
    raise AssertionError("no namespace spreads them")


async def test_a_request_s_budgets_on_three_shards_of_a_redis_cluster(caplog: pytest.LogCaptureFixture) -> None:
    require_binary("redis-server")
    caplog.set_level(logging.DEBUG, logger="extproc.state.budgets")
    directory = Path(tempfile.mkdtemp(prefix="extproc-budget-cluster-"))  # short: unix socket paths
    try:
        with ProcessGroup(directory) as procs:
            cluster = LocalCluster(procs, directory, shards=3).start()
            client = connect(parse_store_url(cluster.url))
            assert isinstance(client, RedisCluster)
            try:
                # The client learns the slot map on its first command; on a loaded CI machine that
                # took longer than the store's 50 ms timeout once, and the gateway's own count
                # answered. What is checked here is the commands' shape, so the map comes first.
                await client.initialize()
                namespace = _spread_namespace(("acme", "key/ci-bot", "model/big"), shards=3)
                a, b = _layered(RedisBudgetStore(client, namespace)), _layered(RedisBudgetStore(client, namespace))
                first = await a.admit("acme", 100, NOW, key_digest=api_key_digest(KEY), model="big")
                await a.settle(first, Usage(input=100, output=380), NOW)
                used = await b.store.used(["acme", "key/ci-bot", "model/big"], NOW)
                assert [u["minute"] for u in used] == [480, 480, 480]
                refused = await b.admit("acme", 100, NOW, key_digest=api_key_digest(KEY), model="big")
                assert not refused.admitted and refused.refused_by == "key"
                assert a.store_failures == b.store_failures == 0, caplog.text  # no CROSSSLOT: one command per slot
                assert cluster.keys_per_node(f"{{budget:{namespace}:*") == [2, 2, 2]  # one budget a shard
            finally:
                await client.aclose()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
