"""A timed answer through the ext_proc stream: its prefill ends at its first streamed token, not at
its headers (vLLM sends those at once); its TTFT and TPOT are learned from its body's events and
the usage the engine reports, never from max_tokens; a non-streamed answer's first token is its
headers less the engine's decode time."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.server.stream import RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.request.token_clock import TokenClock
from extproc.routing.model import Replica
from tests.conftest import body_message, chat_body, headers_message, make_config, response_headers_message
from tests.helpers import Clock

CHAT = "/v1/chat/completions"
PROMPT = "a long document, sentence after sentence. " * 100  # about 1050 tokens
ONE = (Replica("r0", "127.0.0.1:8100"),)


def sse(obj: dict[str, object] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


ROLE = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
EMPTY = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]})  # a token with no text yet
FINISH = sse({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]})
USAGE = sse({"choices": [], "usage": {"prompt_tokens": 1050, "completion_tokens": 9}})


def body_chunk(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def pending(r: Router) -> int:
    return r.replicas.snapshot(r.clock()).get("r0").pending_prefill_tokens  # type: ignore[union-attr]


def timed_router(clock: Clock) -> Router:
    return Router(make_config(replicas=ONE, health=HealthSettings(latency_models="always")), clock=clock)


async def test_a_streams_first_token_not_its_headers_ends_its_prefill_and_its_tokens_come_from_its_usage() -> None:
    clock = Clock(100.0)
    r = timed_router(clock)
    stream = RequestStream(Planner(r))
    await stream.answer(headers_message({":path": CHAT, "x-session-id": "s"}))
    # max_tokens far above what it generates: the TPOT must not be divided by it.
    (answer,) = await stream.answer(body_message(chat_body(PROMPT, stream=True, max_tokens=500)))
    sent = json.loads(answer.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}  # asked, for its output tokens
    assert pending(r) > 1000
    clock.now += 0.01
    (headers_answer,) = await stream.answer(response_headers_message(200))
    # Its body is asked for, streamed: the headers said nothing of the first token.
    assert headers_answer.mode_override.response_body_mode == pm.ProcessingMode.STREAMED
    assert pending(r) > 1000
    assert stream.plan is not None and stream.plan.routed.answered_at is None
    clock.now += 0.49
    await stream.answer(body_chunk(b": keep-alive\n\n"))  # a comment is no token
    assert pending(r) > 1000
    await stream.answer(body_chunk(ROLE))  # vLLM's role chunk comes with the first output
    assert pending(r) == 0
    assert r.latency.view().fits["r0"].ttft_samples == 1  # learned now, from 0.5 s
    routed = stream.plan.routed
    assert routed.answered_at == 100.5 and routed.first_token_seen
    for _ in range(7):
        clock.now += 0.02
        await stream.answer(body_chunk(EMPTY))
    clock.now += 0.02
    await stream.answer(body_chunk(FINISH))
    (last,) = await stream.answer(body_chunk(USAGE + sse("[DONE]"), end=True))
    # The client did not ask for the usage chunk: it is taken out.
    assert b'"usage"' not in last.response_body.response.body_mutation.body
    # 9 tokens reported (the events, 9 with the role chunk, are only a floor): 8 gaps in 0.16 s.
    assert abs(routed.tpot_s - 0.16 / 8) < 1e-9  # type: ignore[operator]
    stream.planner.end(stream.plan)  # the ext_proc stream is over
    assert r.latency.view().fits["r0"].tpot_samples == 1


async def test_a_non_streamed_answers_first_token_is_its_headers_less_the_engines_decode() -> None:
    clock = Clock(100.0)
    r = timed_router(clock)
    r.replicas.apply_scrape("r0", ReplicaMetrics(itl_sum=1.0, itl_count=100.0), clock.now)
    r.replicas.apply_scrape("r0", ReplicaMetrics(itl_sum=3.0, itl_count=200.0), clock.now)  # 20 ms a gap
    stream = RequestStream(Planner(r))
    await stream.answer(headers_message({":path": CHAT, "x-session-id": "s"}))
    await stream.answer(body_message(chat_body(PROMPT, max_tokens=500)))
    clock.now += 0.7
    (headers_answer,) = await stream.answer(response_headers_message(200))
    assert headers_answer.mode_override.response_body_mode == pm.ProcessingMode.STREAMED
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}], "usage": {}}
    reply["usage"] = {"prompt_tokens": 1050, "completion_tokens": 11}
    await stream.answer(body_chunk(json.dumps(reply).encode(), end=True))
    assert stream.plan is not None
    routed = stream.plan.routed
    # 0.7 s in all, 10 gaps of 20 ms: its first token 0.5 s after it was sent.
    assert routed.first_token_seen and abs(routed.answered_at - 100.5) < 1e-9  # type: ignore[operator]
    assert routed.tpot_s == 0.02 and pending(r) == 0


def test_the_clock_counts_token_events_and_reads_the_first_from_the_role_chunk() -> None:
    clock = TokenClock()
    assert not clock.feed(b": keep-alive\n\n", 1.0)
    assert clock.feed(ROLE + EMPTY, 2.0) and clock.first_at == 2.0
    assert not clock.feed(FINISH, 3.0)
    assert not clock.feed(USAGE + sse("[DONE]"), 4.0)
    assert clock.last_at == 3.0
    assert clock.output_tokens(None) == 2 and clock.output_tokens(40) == 40


async def test_a_timed_stream_without_a_token_within_the_first_byte_budget_is_ended_and_counted() -> None:
    from extproc.base.upstream_timeouts import UpstreamTimeouts

    config = make_config(
        replicas=ONE,
        health=HealthSettings(latency_models="always"),
        upstream=UpstreamTimeouts(first_byte_s=0.2, stream_idle_s=1.0, unary_max_s=0),
    )
    r = Router(config)
    late = asyncio.Event()

    async def source(delay_s: float) -> AsyncIterator[pb.ProcessingRequest]:
        yield headers_message({":path": CHAT, "x-session-id": "s"})
        yield body_message(chat_body(PROMPT, stream=True))
        yield response_headers_message(200)  # vLLM's: at once
        await asyncio.sleep(delay_s)  # the engine is stuck (or slow)
        late.set()
        yield body_chunk(ROLE)
        yield body_chunk(FINISH + sse("[DONE]"), end=True)

    started = time.monotonic()
    out = [a async for a in RequestStream(Planner(r)).run(source(0.6))]
    ended = [a for a in out if a.HasField("immediate_response")]
    assert len(ended) == 1 and ended[0].immediate_response.status.code == 504
    assert ended[0].immediate_response.details == "first_token_timeout"
    assert out.index(ended[0]) == 3  # before the late token, answered after it unchanged
    assert time.monotonic() - started > 0.15 and late.is_set()
    assert r.metrics.first_token_timeouts.labels("r0")._value.get() == 1
    assert r.replicas.snapshot(r.clock()).get("r0").inflight == 0  # type: ignore[union-attr]
    # A token in time: nothing ended, nothing counted.
    out = [a async for a in RequestStream(Planner(r)).run(source(0.01))]
    assert not any(a.HasField("immediate_response") for a in out)
    assert r.metrics.first_token_timeouts.labels("r0")._value.get() == 1


async def test_before_the_engine_reports_a_gap_a_non_streamed_answer_is_judged_but_not_learnt_from() -> None:
    clock = Clock(100.0)
    r = timed_router(clock)  # no scrape yet: no inter-token gap known
    met = r.metrics.objective_requests
    stream = RequestStream(Planner(r))
    await stream.answer(headers_message({":path": CHAT, "x-session-id": "s", "x-slo-ttft-ms": "600"}))
    await stream.answer(body_message(chat_body(PROMPT, max_tokens=500)))
    clock.now += 0.65
    await stream.answer(response_headers_message(200))
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}], "usage": {}}
    reply["usage"] = {"prompt_tokens": 1050, "completion_tokens": 11}
    await stream.answer(body_chunk(json.dumps(reply).encode(), end=True))
    assert stream.plan is not None
    routed = stream.plan.routed
    # Placed with the built-in prior's decode step (10 ms): 0.55 s, within its 600 ms.
    assert routed.first_token_estimated and not routed.first_token_seen
    assert abs(routed.answered_at - 100.55) < 1e-9  # type: ignore[operator]
    stream.planner.end(stream.plan)
    assert met.labels("default", "met")._value.get() == 1
    assert "r0" not in r.latency.view().fits  # nothing learnt from a prior


async def test_a_retried_streams_first_token_budget_runs_from_its_headers_and_blames_no_one() -> None:
    clock = Clock(100.0)
    r = timed_router(clock)
    routed = await r.route({":path": CHAT}, chat_body(PROMPT, stream=True), timed=True)
    budget = r.config.upstream.first_byte_s
    assert r.outcomes.first_token_deadline(routed) is None  # nothing waited for before its headers
    clock.now += budget + 0.5  # the first try timed out; Envoy's second answered
    r.outcomes.observe_response(routed, 200, attempts=2, answered_by="127.0.0.1:9", timed=True)
    assert r.outcomes.first_token_deadline(routed) == clock.now + budget
    errors = r.replicas.record("r0").errors  # type: ignore[union-attr]
    assert errors == 1  # its own try's timeout, counted as before
    r.outcomes.first_token_overdue(routed)  # the other replica's try stalled: not r0's doing
    assert r.outcomes.first_token_deadline(routed) is None
    assert r.replicas.record("r0").errors == errors  # type: ignore[union-attr]


def test_what_is_timed_follows_the_latency_models_unless_token_timing_says() -> None:
    def times(**health: object) -> tuple[bool, bool]:
        r = Router(make_config(replicas=ONE, health=HealthSettings(**health)))  # type: ignore[arg-type]
        return r.watching.times_tokens({}), r.watching.times_tokens({"x-slo-ttft-ms": "200"})

    assert times() == (False, True)  # auto: only once a request may carry an objective
    assert times(latency_models="always") == (True, True)
    assert times(latency_models="off") == (False, False)
    assert times(token_timing="always") == (True, True)
    assert times(latency_models="always", token_timing="off") == (False, False)


def test_token_timing_rate_times_that_share_of_the_answers_it_would_time() -> None:
    r = Router(make_config(replicas=ONE, health=HealthSettings(latency_models="always", token_timing_rate=0.25)))
    planner = Planner(r)
    watches = [planner.watch(can_override=True, whole_body=True, headers={}) for _ in range(40)]
    assert sum(w.timed for w in watches) == 10 and all(w.sampled for w in watches)
