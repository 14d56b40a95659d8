"""Token metering: kinds that add up, bounded tenants and models, and the counters a response's
reported usage moves in /metrics, through the planner as the ext_proc stream drives it (a JSON
body and a stream whose client did not ask for its usage chunk)."""

from __future__ import annotations

import json
import time

from prometheus_client import generate_latest

from extproc.app.plan import Planner, Watch
from extproc.app.router import Router, known_tenants
from extproc.config import Config
from extproc.observe.metrics import RouterMetrics
from extproc.request.usage import Usage
from extproc.state.budgets import BudgetSettings, TokenBudget
from extproc.state.metering import OTHER, TokenMeter, UsageRow
from extproc.state.tenancy import TenantSettings
from tests.conftest import chat_body, make_config

CHAT = "/v1/chat/completions"
KEY = "sk-live-do-not-print-7f3a"


class Recorder:
    """A MeterObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, int, int, int]] = []

    def tokens_used(self, tenant: str, model: str, replica: str, input: int, cached_input: int, output: int) -> None:
        self.calls.append((tenant, model, replica, input, cached_input, output))


def test_kinds_are_disjoint_and_add_up_to_what_the_response_used() -> None:
    seen = Recorder()
    meter = TokenMeter({"acme"}, seen)
    meter.charge("acme", "m", "r0", Usage(input=100, cached_input=64, output=10))
    meter.charge("acme", "m", "r1", Usage(input=50, cached_input=None, output=5))  # no cached report
    assert meter.rows() == [UsageRow("acme", "m", 36 + 50, 64, 15)]
    assert meter.rows()[0].total == 100 + 10 + 50 + 5
    assert seen.calls == [("acme", "m", "r0", 36, 64, 10), ("acme", "m", "r1", 50, 0, 5)]


def test_unknown_tenants_and_models_past_the_cap_fall_into_other() -> None:
    seen = Recorder()
    meter = TokenMeter({"acme"}, seen, max_models=2)
    for tenant, model in (("acme", "a"), ("from-a-header", "b"), ("", "c"), ("acme", "a"), ("acme", "d")):
        meter.charge(tenant, model, "", Usage(input=1, output=1))
    meter.charge("acme", "a", "r0", Usage())  # nothing reported: nothing counted, no series
    assert {(r.tenant, r.model): r.input for r in meter.rows()} == {
        ("acme", "a"): 2,
        (OTHER, "b"): 1,
        (OTHER, OTHER): 1,
        ("acme", OTHER): 1,
    }
    assert {c[2] for c in seen.calls} == {"none"}  # no replica chosen: the default route
    assert len(seen.calls) == 5


def test_the_config_names_the_tenants_metered_by_name() -> None:
    cfg = Config(
        tenants=TenantSettings(api_keys={"a" * 64: "keyed"}, definitions={"quota": {"max_concurrent": 2}}),
        budgets=BudgetSettings(enabled=True, tenants={"budgeted": TokenBudget(per_minute=10)}),
    )
    assert known_tenants(cfg) == {"keyed", "quota", "budgeted"}


async def _serve(planner: Planner, headers: dict[str, str], body: bytes, *answer: bytes) -> None:
    """One request through the planner: routed, answered 200 with ``answer`` in pieces, over."""
    plan = await planner.plan(headers, body, Watch(sampled=True, meter=True))
    assert planner.response_headers(plan, {":status": "200"})
    for i, piece in enumerate(answer):
        await planner.response_body(plan, piece, i == len(answer) - 1)
    planner.end(plan)


async def test_a_response_s_usage_moves_the_counters_by_tenant_model_replica_and_kind() -> None:
    metrics = RouterMetrics()
    cfg = make_config(
        budgets=BudgetSettings(enabled=True, tenants={"acme": TokenBudget(per_day=10**6)}),
        tenants=TenantSettings(trust_header=True),
    )
    router = Router(cfg, metrics=metrics)
    planner = Planner(router)
    usage = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}
    headers = {":path": CHAT, "x-tenant-id": "acme", "authorization": f"Bearer {KEY}"}
    await _serve(planner, headers, chat_body("hello " * 40), json.dumps({"choices": [{}], "usage": usage}).encode())
    # A stream whose client did not ask for usage: the router asked, and reads the chunk it takes out.
    chunks = [
        b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":3}}\n\n',
        b"data: [DONE]\n\n",
    ]
    await _serve(planner, {":path": CHAT, "x-tenant-id": "walk-in"}, chat_body("hi", stream=True), *chunks)

    assert router.meter is not None
    assert router.meter.rows() == [UsageRow("acme", "m", 56, 64, 7), UsageRow(OTHER, "m", 30, 0, 3)]
    value = metrics.registry.get_sample_value
    replicas = {
        name
        for name in ("r0", "r1", "r2")
        if value("extproc_tokens_total", {"tenant": "acme", "model": "m", "replica": name, "kind": "input"})
    }
    assert len(replicas) == 1  # the replica the request went to
    (replica,) = replicas
    for kind, expected in (("input", 56), ("cached_input", 64), ("output", 7)):
        labels = {"tenant": "acme", "model": "m", "replica": replica, "kind": kind}
        assert value("extproc_tokens_total", labels) == expected
    total = sum(
        s.value
        for family in metrics.registry.collect()
        if family.name == "extproc_tokens"
        for s in family.samples
        if s.name == "extproc_tokens_total" and s.labels["tenant"] == OTHER
    )
    assert total == 33
    page = generate_latest(metrics.registry).decode()
    assert KEY not in page and "walk-in" not in page  # never a key, never an unconfigured tenant
    # The tenant with a budget was charged what it used, weighted (cached at 0.25); the walk-in
    # tenant has none and is metered only.
    assert router.budgets is not None
    (standing,) = await router.budgets.standings(time.time())
    assert standing.kind == "tenant" and standing.name == "acme"
    (day,) = standing.windows
    assert day.window == "day" and day.used == 56 + 64 * 0.25 + 7


async def test_without_budgets_enabled_nothing_is_metered() -> None:
    router = Router(make_config())
    assert router.meter is None and router.budgets is None
    planner = Planner(router)
    plan = await planner.plan({":path": CHAT}, chat_body("hello"), Watch(sampled=True))
    assert not planner.response_headers(plan, {":status": "200"})  # the body is not even read
    planner.end(plan)
