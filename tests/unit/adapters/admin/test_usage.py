"""The usage export on a real gRPC admin listener: tokens by tenant and model as the responses
reported them, the budgets left, open to read without the token, and ``extproc admin usage`` as a
table, JSON and CSV."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sys
import time

import grpc

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.adapters.admin.server import AdminServer
from extproc.app.plan import Planner, Watch
from extproc.app.router import Router
from extproc.config import AdminSettings
from extproc.request.tenant import api_key_digest
from extproc.state.budgets import BudgetSettings, KeyBudget, TokenBudget
from extproc.state.tenancy import TenantSettings
from tests.conftest import chat_body, make_config

CHAT = "/v1/chat/completions"
KEY = "sk-billing-test-key-42"


def _router() -> Router:
    budgets = BudgetSettings(
        enabled=True,
        tenants={"acme": TokenBudget(per_minute=100_000, per_day=10**7)},
        keys={"ci-bot": KeyBudget(per_day=5_000, sha256=api_key_digest(KEY))},
    )
    return Router(make_config(budgets=budgets, tenants=TenantSettings(trust_header=True)))


async def _answer(planner: Planner, headers: dict[str, str], model: str, usage: dict[str, object]) -> None:
    plan = await planner.plan({":path": CHAT, **headers}, chat_body("hello " * 10, model=model), Watch(meter=True))
    assert planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, json.dumps({"choices": [{}], "usage": usage}).encode(), True)
    planner.end(plan)


async def _served(router: Router) -> AdminServer:
    server = AdminServer(router, AdminSettings(listen="127.0.0.1:0"))
    await server.bind()
    await server.start()
    return server


async def test_usage_by_tenant_and_model_and_the_budgets_left_over_the_api() -> None:
    router = _router()
    planner = Planner(router)
    cached = {"prompt_tokens": 100, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 40}}
    await _answer(planner, {"x-tenant-id": "acme", "authorization": f"Bearer {KEY}"}, "m", cached)
    await _answer(planner, {"x-tenant-id": "acme"}, "m", {"prompt_tokens": 10, "completion_tokens": 5})
    await _answer(planner, {"x-tenant-id": "acme"}, "m2", {"prompt_tokens": 7, "completion_tokens": 1})
    await _answer(planner, {"x-tenant-id": "walk-in"}, "m", {"prompt_tokens": 3, "completion_tokens": 3})
    server = await _served(router)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            reply = await pb_grpc.AdminStub(channel).GetUsage(pb.UsageRequest())  # a read: no token needed
    finally:
        await server.close(0)
    assert reply.enabled and abs(reply.since - time.time()) < 60
    rows = {(u.tenant, u.model): (u.input_tokens, u.cached_input_tokens, u.output_tokens) for u in reply.usage}
    assert rows == {("acme", "m"): (60 + 10, 40, 25), ("acme", "m2"): (7, 0, 1), ("other", "m"): (3, 0, 3)}
    budgets = {(b.kind, b.name): {w.window: w for w in b.windows} for b in reply.budgets}
    assert set(budgets) == {("tenant", "acme"), ("key", "ci-bot")}
    assert set(budgets[("tenant", "acme")]) == {"minute", "day"} and set(budgets[("key", "ci-bot")]) == {"day"}
    key_day = budgets[("key", "ci-bot")]["day"]
    charged = 60 + 40 * 0.25 + 20  # only the request made with the key
    assert key_day.limit == 5_000 and key_day.used == charged and key_day.remaining == 5_000 - charged
    acme_day = budgets[("tenant", "acme")]["day"]
    assert acme_day.used == charged + 15 + 8
    assert KEY not in str(reply) and api_key_digest(KEY) not in str(reply)


async def test_without_budgets_enabled_the_export_says_metering_is_off() -> None:
    server = await _served(Router(make_config()))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            reply = await pb_grpc.AdminStub(channel).GetUsage(pb.UsageRequest())
    finally:
        await server.close(0)
    assert not reply.enabled and not reply.usage and not reply.budgets


async def test_the_cli_prints_usage_as_a_table_json_and_csv() -> None:
    router = _router()
    planner = Planner(router)
    await _answer(planner, {"x-tenant-id": "acme"}, "m", {"prompt_tokens": 10, "completion_tokens": 5})
    await _answer(planner, {"x-tenant-id": "acme", "authorization": f"Bearer {KEY}"}, "m2", {"prompt_tokens": 4})
    # Abandoned before its answer: charged an estimate, which the export says.
    gone = await planner.plan(
        {":path": CHAT, "x-tenant-id": "acme"}, chat_body("bye " * 40, model="m3"), Watch(meter=True)
    )
    planner.end(gone)
    server = await _served(router)

    async def cli(*argv: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "admin", "--server", server.address, *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return out.decode()

    try:
        table, as_json, as_json_too, as_csv = await asyncio.gather(
            cli("usage"), cli("usage", "--json"), cli("--json", "usage"), cli("usage", "--csv")
        )
    finally:
        await server.close(0)
    assert "TENANT" in table and "ci-bot" in table and "REMAINING" in table
    exported = json.loads(as_json)
    again = json.loads(as_json_too)  # ``admin --json usage`` is the same export
    assert (again["since"], again["usage"]) == (exported["since"], exported["usage"])
    assert [row for row in exported["usage"] if row["model"] != "m3"] == [
        {
            "tenant": "acme",
            "model": "m",
            "input_tokens": 10,
            "cached_input_tokens": 0,
            "output_tokens": 5,
            "total_tokens": 15,
            "estimated_tokens": 0,
        },
        {
            "tenant": "acme",
            "model": "m2",
            "input_tokens": 4,
            "cached_input_tokens": 0,
            "output_tokens": 0,
            "total_tokens": 4,
            "estimated_tokens": 0,
        },
    ]
    # Abandoned: its prompt, and what the time it ran (a few ms here) makes of its output.
    m3 = next(row for row in exported["usage"] if row["model"] == "m3")
    assert m3["input_tokens"] == gone.routed.features.charged_prompt_tokens() > 0
    assert m3["estimated_tokens"] == m3["total_tokens"]
    assert "ESTIMATED" in table
    (key,) = (b for b in exported["budgets"] if b["kind"] == "key")
    assert key["name"] == "ci-bot" and key["windows"][0]["used"] == 4
    rows = list(csv.DictReader(io.StringIO(as_csv)))
    assert [(r["tenant"], r["model"], r["input_tokens"], r["output_tokens"], r["total_tokens"]) for r in rows] == [
        ("acme", "m", "10", "5", "15"),
        ("acme", "m2", "4", "0", "4"),
        ("acme", "m3", str(m3["input_tokens"]), str(m3["output_tokens"]), str(m3["total_tokens"])),
    ]
    assert rows[0]["since"] == exported["since"]
    assert KEY not in table + as_json + as_csv
