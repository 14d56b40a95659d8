"""Every request that reached an engine is charged (issue 39): a stream cut short is charged its
prompt and the output it was seen to carry, an answer never seen its prompt and an estimate from
the time it ran, a body not parsed its size; other APIs that run the model are metered or refused;
a request refused or answered with an error is charged nothing. The usage export says which
tokens were estimated."""

from __future__ import annotations

import json

from extproc.app.plan import Forward, Planner, Refuse, Watch
from extproc.app.router import Router
from extproc.config import Request
from extproc.request.usage import Usage, UsageTail, parse_usage
from extproc.state.budgets import BudgetSettings, TokenBudget
from extproc.state.metering import UsageRow
from extproc.state.tenancy import TenantSettings
from tests.conftest import chat_body, make_config
from tests.helpers import as_tenant, tenant_api_keys

CHAT = "/v1/chat/completions"
ACME = {":path": CHAT, **as_tenant("acme")}
ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'


def token(text: str) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"' + text.encode() + b'"}}],"usage":null}\n\n'


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(clock: Clock | None = None, **budgets: object) -> Router:
    settings = BudgetSettings(enabled=True, tenants={"acme": TokenBudget(per_day=10**6)}, **budgets)  # type: ignore[arg-type]
    cfg = make_config(budgets=settings, tenants=TenantSettings(api_keys=tenant_api_keys("acme")))
    return Router(cfg, clock=clock) if clock is not None else Router(cfg)


def used(r: Router) -> float:
    """What acme's day window holds on this gateway."""
    assert r.budgets is not None
    return sum(v for (subject, window, _), v in r.budgets.local._counts.items() if (subject, window) == ("acme", "day"))


async def test_a_stream_abandoned_after_its_first_chunks_is_charged_its_prompt_and_the_output_seen() -> None:
    r = router()
    planner = Planner(r)
    body = chat_body("tell me a long story " * 20, stream=True)
    plan = await planner.plan(ACME, body, Watch(meter=True))
    assert isinstance(plan.action, Forward)
    prompt = plan.routed.features.charged_prompt_tokens()
    assert prompt > 50
    assert planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, ROLE + token("Once"), False)
    await planner.response_body(plan, token(" upon"), False)
    planner.end(plan)  # the client went away: no usage chunk ever came
    assert used(r) == prompt + 2  # the role-only chunk carries no token: never more than generated
    assert r.meter is not None
    (row,) = r.meter.rows()
    assert (row.input, row.output, row.estimated) == (prompt, 2, prompt + 2)
    assert r.budgets is not None and r.budgets.reserved == {}
    planner.end(plan)  # a second end charges nothing more
    assert used(r) == prompt + 2


async def test_a_stream_that_reports_its_usage_is_charged_that_and_nothing_estimated() -> None:
    r = router()
    planner = Planner(r)
    plan = await planner.plan(ACME, chat_body("hi", stream=True), Watch(meter=True))
    planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, ROLE + token("a"), False)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    await planner.response_body(plan, usage, True)
    planner.end(plan)
    assert used(r) == 11
    assert r.meter is not None and r.meter.rows()[0].estimated == 0


async def test_an_answer_never_seen_is_charged_its_prompt_and_output_from_the_time_it_ran() -> None:
    clock = Clock()
    r = router(clock, output_tokens_per_s=10.0)
    planner = Planner(r)
    plan = await planner.plan(ACME, chat_body("summarise " * 40, max_tokens=500), Watch(meter=True))
    prompt = plan.routed.features.charged_prompt_tokens()
    clock.now += 4.0  # four seconds in, the client gives up before the JSON answer
    planner.end(plan)
    assert used(r) == prompt + 40
    # Capped by its max_tokens.
    plan = await planner.plan(ACME, chat_body("short", max_tokens=5), Watch(meter=True))
    clock.now += 60.0
    planner.end(plan)
    assert used(r) == prompt + 40 + plan.routed.features.charged_prompt_tokens() + 5


async def test_a_non_streamed_answer_cut_mid_body_is_charged_the_output_it_ran_for() -> None:
    """Its usage is at the end of its body, never seen: its prompt and the output estimated from
    the time it ran (an answer's headers leave once the engine is done), marked as estimated."""
    clock = Clock()
    r = router(clock, output_tokens_per_s=10.0)
    planner = Planner(r)
    plan = await planner.plan(ACME, chat_body("summarise " * 40, max_tokens=500), Watch(meter=True))
    prompt = plan.routed.features.charged_prompt_tokens()
    clock.now += 3.0
    assert planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"Once', False)
    planner.end(plan)  # the connection was cut before the rest (and its usage) came
    assert used(r) == prompt + 30
    assert r.meter is not None
    (row,) = r.meter.rows()
    assert (row.input, row.output, row.estimated) == (prompt, 30, prompt + 30)
    assert r.budgets is not None and r.budgets.reserved == {}


async def test_refused_errored_and_unstarted_streams_are_charged_nothing() -> None:
    r = router()
    planner = Planner(r)
    plan = await planner.plan(ACME, chat_body("bad"), Watch(meter=True))
    assert not planner.response_headers(plan, {":status": "400"})  # the engine refused it
    planner.end(plan)
    stream = await planner.plan(ACME, chat_body("gone", stream=True), Watch(meter=True))
    planner.end(stream)  # no answer at all: a stream's headers come before any engine step
    assert used(r) == 0
    assert r.budgets is not None and r.budgets.reserved == {}


async def test_a_body_not_parsed_reserves_by_its_size_is_refused_out_of_budget_and_charged_its_events() -> None:
    settings = BudgetSettings(enabled=True, tenants={"acme": TokenBudget(per_minute=1000)})
    cfg = make_config(
        budgets=settings, tenants=TenantSettings(api_keys=tenant_api_keys("acme")), request=Request(max_body_bytes=100)
    )
    r = Router(cfg)
    planner = Planner(r)
    big = chat_body("x" * 8000, stream=True)  # over max_body_bytes: not parsed, not asked for usage
    refused = await planner.plan(ACME, big, Watch(meter=True))
    assert isinstance(refused.action, Refuse) and refused.action.status == 429  # 2,000+ tokens > 1,000
    planner.end(refused)
    small = chat_body("y" * 2000, stream=True)  # still over 100 bytes: about 500 tokens by size
    plan = await planner.plan(ACME, small, Watch(meter=True))
    assert isinstance(plan.action, Forward) and plan.routed.features.body_error is not None
    assert plan.routed.features.charged_prompt_tokens() == len(small) // 4
    planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, ROLE + token("a") + token("b") + b"data: [DONE]\n\n", True)
    planner.end(plan)
    assert used(r) == len(small) // 4 + 2
    assert r.meter is not None and r.meter.rows()[0].estimated == len(small) // 4 + 2
    # A model whose tokenizer cuts finer: the operator says so, and such a body is charged more.
    finer = Router(
        make_config(budgets=BudgetSettings(enabled=True, bytes_per_token=2.0), request=Request(max_body_bytes=100))
    )
    plan = await Planner(finer).plan(ACME, small, Watch(meter=True))
    assert finer.charges.estimated_usage(plan.routed, 0).input == len(small) // 2


async def test_other_apis_that_run_the_model_are_metered_or_refused() -> None:
    r = router()
    planner = Planner(r)
    headers = {**ACME, ":path": "/v1/embeddings"}
    plan = await planner.plan(headers, json.dumps({"model": "e", "input": "hello world"}).encode(), Watch(meter=True))
    assert isinstance(plan.action, Forward)
    assert planner.response_headers(plan, {":status": "200"})
    answer = {"data": [{"embedding": [0.1]}], "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    await planner.response_body(plan, json.dumps(answer).encode(), True)
    planner.end(plan)
    assert used(r) == 7 and r.meter is not None and r.meter.rows()[0].estimated == 0
    # The Responses API's names.
    plan = await planner.plan({**ACME, ":path": "/v1/responses"}, b'{"model":"m","input":"hi"}', Watch(meter=True))
    planner.response_headers(plan, {":status": "200"})
    await planner.response_body(plan, b'{"output":[],"usage":{"input_tokens":5,"output_tokens":4}}', True)
    planner.end(plan)
    assert used(r) == 16
    # Refused by config: 403 before any replica, charged nothing.
    refusing = Planner(router(other_paths="refuse"))
    for path in (
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/rerank",
        "/pooling",
        "/score",
        "/v1/chat/completions/batch",
    ):
        plan = await refusing.plan({**ACME, ":path": path}, b"{}", Watch(meter=True))
        assert isinstance(plan.action, Refuse) and plan.action.status == 403, path
        assert plan.action.retry_after_s is None
        refusing.end(plan)
    chat = await refusing.plan(ACME, chat_body("hi"), Watch(meter=True))
    assert isinstance(chat.action, Forward)
    refusing.end(chat)
    # The Responses and Messages APIs are read as chat is (their prompt, model and session): never "other".
    for path, body in (
        ("/v1/responses", {"model": "m", "input": "hi"}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        plan = await refusing.plan({**ACME, ":path": path}, json.dumps(body).encode(), Watch(meter=True))
        assert isinstance(plan.action, Forward) and plan.routed.features.model == "m", path
        refusing.end(plan)


def test_usage_reports_of_every_api_are_read() -> None:
    assert parse_usage({"prompt_tokens": 3, "completion_tokens": 2}) == Usage(3, None, 2)
    assert parse_usage({"input_tokens": 5, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 2}}) == Usage(
        5, 2, 4
    )
    assert parse_usage({"input_tokens": 5, "output_tokens": 4, "cache_read_input_tokens": 3}) == Usage(8, 3, 4)
    # vLLM's /v1/messages: input_tokens is the prompt less what was read from and written to the cache.
    messages = {
        "input_tokens": 10,
        "output_tokens": 8,
        "cache_creation_input_tokens": 512,
        "cache_read_input_tokens": 0,
    }
    assert parse_usage(messages) == Usage(522, 0, 8)
    assert parse_usage({"total_tokens": 12}) == Usage(12, None, 0)
    tail = UsageTail()
    tail.feed(b'{"text":"hi","usage":{"type":"duration","seconds":3}}')
    assert tail.usage() is None  # seconds, not tokens: charged as an estimate


def test_events_are_counted_across_piece_boundaries() -> None:
    stream = ROLE + token("a") + token("b") + token("c")
    for cut in range(1, len(stream)):
        tail = UsageTail()
        tail.feed(stream[:cut])
        tail.feed(stream[cut:])
        assert (tail.events, tail.roles, tail.output_seen) == (4, 1, 3), cut
    answer = UsageTail()  # a JSON answer names its message's role: no event, no token
    answer.feed(b'{"choices":[{"message":{"role":"assistant","content":"hi"}}]}')
    assert (answer.events, answer.roles, answer.output_seen) == (0, 0, 0)


def test_the_export_rows_carry_the_estimated_tokens() -> None:
    assert UsageRow("a", "m", 1, 2, 3).estimated == 0
