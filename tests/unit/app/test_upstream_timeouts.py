"""Per-try bounds: what the processor tells Envoy per request, what the rendered config holds,
and how a try that failed on the chosen replica counts against it."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.envoy_config import GatewaySpec, render
from extproc.adapters.server.stream import RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.base.upstream_timeouts import PER_TRY_TIMEOUT_HEADER, UpstreamTimeouts, attempts
from extproc.config import ConfigError, config_from_mapping
from extproc.fleet.health.replicas import ReplicaBook
from extproc.request.openai_body import max_output_tokens
from extproc.routing.model import Replica
from tests.conftest import body_message, headers_message, make_config, set_headers
from tests.helpers import Clock


def test_streams_are_marked_and_non_streaming_requests_get_a_bound_from_max_tokens() -> None:
    t = UpstreamTimeouts(first_byte_s=8.0, unary_s_per_output_token=0.3, unary_max_s=60.0)
    assert t.request_headers(stream=True, max_output_tokens=500) == [("x-extproc-stream", "1")]
    assert t.request_headers(stream=False, max_output_tokens=100) == [(PER_TRY_TIMEOUT_HEADER, "38000")]
    assert t.request_headers(stream=False, max_output_tokens=0) == [(PER_TRY_TIMEOUT_HEADER, "8000")]


@pytest.mark.parametrize("max_tokens", [None, 174, 100_000, 10**12])
def test_a_non_streaming_budget_never_exceeds_unary_max_s(max_tokens: int | None) -> None:
    # Without max_tokens (the answer may run to the model's context) or with a huge one, the try
    # still has a bound: a hung replica costs at most unary_max_s before another one is asked.
    t = UpstreamTimeouts(first_byte_s=8.0, unary_s_per_output_token=0.3, unary_max_s=60.0)
    assert t.unary_budget_s(max_tokens) == 60.0
    assert t.request_headers(stream=False, max_output_tokens=max_tokens) == [(PER_TRY_TIMEOUT_HEADER, "60000")]


def test_without_the_cap_only_max_tokens_bounds_a_non_streaming_try() -> None:
    # unary_max_s: 0, for an Envoy whose routes do not hedge (a per-try timeout would cut).
    t = UpstreamTimeouts(first_byte_s=8.0, unary_s_per_output_token=0.3, unary_max_s=0)
    assert t.request_headers(stream=False, max_output_tokens=None) == [(PER_TRY_TIMEOUT_HEADER, "0")]
    assert t.request_headers(stream=False, max_output_tokens=1000) == [(PER_TRY_TIMEOUT_HEADER, "308000")]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 7}, 7),
        ({"max_completion_tokens": 9, "max_tokens": 7}, 9),
        ({"max_tokens": True}, None),
        ({"max_tokens": -1}, None),
        ({"max_tokens": "12"}, None),
        ({}, None),
    ],
)
def test_max_output_tokens_reads_only_sane_integers(body: dict[str, object], expected: int | None) -> None:
    assert max_output_tokens(body) == expected


def test_attempt_count_header_parsing() -> None:
    assert [attempts(v) for v in (None, "", "1", "2", "x", "0")] == [1, 1, 1, 2, 1, 1]


def test_upstream_section_is_validated_naming_the_field() -> None:
    cfg = config_from_mapping({"upstream": {"first_byte_s": 2, "stream_idle_s": 7, "stream_header": "X-S"}})
    assert (cfg.upstream.first_byte_s, cfg.upstream.stream_idle_s, cfg.upstream.stream_header) == (2.0, 7.0, "x-s")
    assert "x-s" in cfg.routing_headers  # a client never sets it itself
    with pytest.raises(ConfigError, match=r"upstream\.first_byte: unknown key"):
        config_from_mapping({"upstream": {"first_byte": 2}})
    with pytest.raises(ConfigError, match=r"upstream\.first_byte_s"):
        config_from_mapping({"upstream": {"first_byte_s": 0}})
    assert config_from_mapping({"upstream": {"unary_max_s": 30}}).upstream.unary_max_s == 30.0
    with pytest.raises(ConfigError, match=r"upstream\.unary_max_s: 5 s is below first_byte_s 8 s"):
        config_from_mapping({"upstream": {"unary_max_s": 5}})


def _decide(body: dict[str, object]) -> dict[str, str]:
    async def run() -> pb.ProcessingResponse:
        stream = RequestStream(Planner(Router(make_config())))
        await stream.answer(headers_message({":path": "/v1/chat/completions", "x-session-id": "a"}))
        (answer,) = await stream.answer(body_message(json.dumps(body).encode()))
        return answer

    return set_headers(asyncio.run(run()).request_body.response.header_mutation)


def test_the_decision_carries_the_per_try_bound() -> None:
    messages = [{"role": "user", "content": "hi"}]
    streamed = _decide({"model": "m", "stream": True, "messages": messages})
    assert streamed["x-extproc-stream"] == "1" and PER_TRY_TIMEOUT_HEADER not in streamed
    unary = _decide({"model": "m", "max_tokens": 10, "messages": messages})
    assert unary[PER_TRY_TIMEOUT_HEADER] == "11000" and "x-extproc-stream" not in unary
    unbounded = _decide({"model": "m", "messages": messages})
    assert unbounded[PER_TRY_TIMEOUT_HEADER] == "60000"  # unary_max_s: no max_tokens is not "no bound"


def test_rendered_routes_bound_each_try_and_idle_streams() -> None:
    spec = GatewaySpec(replicas=[Replica("a", "127.0.0.1:1"), Replica("b", "127.0.0.1:2")])
    hcm = render(spec)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    assert vhost["include_attempt_count_in_response"] is True
    stream_route, routed, default = vhost["routes"]
    assert [h["name"] for h in stream_route["match"]["headers"]] == ["x-target-cluster", "x-extproc-stream"]
    assert stream_route["route"]["idle_timeout"] == "25s"
    assert stream_route["route"]["retry_policy"]["per_try_timeout"] == "8s"
    assert routed["route"]["retry_policy"]["per_try_timeout"] == "8s" and "idle_timeout" not in routed["route"]
    # A stream's silent try is reset and retried; a non-streaming one's budget hedges (the first
    # try keeps running), since a replica still generating is as silent as a hung one.
    assert "hedge_policy" not in stream_route["route"]
    assert routed["route"]["hedge_policy"] == {"hedge_on_per_try_timeout": True}
    for route in (stream_route, routed):  # the answering replica's address, for the processor only
        assert route["response_headers_to_add"][0]["header"] == {
            "key": "x-extproc-answered-by",
            "value": "%UPSTREAM_REMOTE_ADDRESS%",
        }
    assert hcm["http_filters"][0]["typed_config"]["mutations"]["response_mutations"] == [
        {"remove": "x-extproc-answered-by"}
    ]
    # Unrouted (the processor down): nothing known about the request, only the route timeout.
    assert "per_try_timeout" not in default["route"]["retry_policy"]
    ext_proc = hcm["http_filters"][1]["typed_config"]
    assert ext_proc["mutation_rules"] == {"allow_envoy": True}


def test_an_idle_timeout_shorter_than_the_tries_before_the_headers_is_refused() -> None:
    spec = GatewaySpec(replicas=[Replica("a", "127.0.0.1:1")], first_byte_timeout_s=5, stream_idle_timeout_s=15)
    with pytest.raises(ValueError, match="stream_idle_timeout_s"):
        render(spec)


def _response_headers(status: int, attempt_count: int, answered_by: str | None = None) -> pb.ProcessingRequest:
    hv = [
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="x-envoy-attempt-count", raw_value=str(attempt_count).encode()),
    ]
    if answered_by is not None:
        hv.append(base_pb2.HeaderValue(key="x-extproc-answered-by", raw_value=answered_by.encode()))
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv)))


def test_answers_retried_after_the_first_byte_timeout_eject_the_chosen_replica() -> None:
    clock = Clock()
    router = Router(make_config(), clock=clock)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()

    async def one(attempt_count: int, waited_s: float = 0.01) -> str:
        stream = RequestStream(Planner(router))
        await stream.answer(headers_message({":path": "/v1/chat/completions", "x-session-id": "s"}))
        await stream.answer(body_message(body))
        assert stream.plan is not None and stream.plan.routed.decision.replica is not None
        routed = stream.plan.routed
        clock.now += waited_s
        await stream.answer(_response_headers(200, attempt_count))
        router.release(routed)
        return routed.decision.replica.name

    async def run() -> tuple[str, list[str]]:
        first = await one(1)
        for _ in range(5):  # quick retries (connection refused, reset): the scraper judges those
            assert await one(2) == first
        assert router.replicas.evaluate(clock.now) == []
        for _ in range(3):  # a 200 another replica gave after the chosen one's try met the timeout
            assert await one(2, waited_s=router.config.upstream.first_byte_s + 0.1) == first
        return first, [t.replica for t in router.replicas.evaluate(clock.now) if not t.in_rotation]

    chosen, ejected = asyncio.run(run())
    assert ejected == [chosen]  # reported by the next evaluation: counted and its sessions moved
    assert not next(r for r in router.replicas.records() if r.replica.name == chosen).rotation.in_rotation


def test_a_hedged_answer_from_the_chosen_replica_is_not_its_failure() -> None:
    """A non-streaming try past its budget is hedged, not reset: when the chosen replica's own
    (slow) answer wins, Envoy still counts two attempts, and the answering address tells."""
    clock = Clock()
    router = Router(make_config(), clock=clock)
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}).encode()
    waited_s = router.config.upstream.first_byte_s + 0.1

    async def one(answered_by: str | None) -> str:
        stream = RequestStream(Planner(router))
        await stream.answer(headers_message({":path": "/v1/chat/completions", "x-session-id": "s"}))
        await stream.answer(body_message(body))
        assert stream.plan is not None and stream.plan.routed.decision.replica is not None
        chosen = stream.plan.routed.decision.replica
        clock.now += waited_s
        await stream.answer(_response_headers(200, 2, answered_by or chosen.address))
        router.release(stream.plan.routed)
        return chosen.name

    async def run() -> tuple[str, list[str]]:
        names = {await one(None) for _ in range(4)}  # answered by the chosen replica itself
        assert len(names) == 1
        still = [t.replica for t in router.replicas.evaluate(clock.now) if not t.in_rotation]
        for _ in range(3):  # answered by another replica: the chosen one's try failed
            await one("127.0.0.1:9")
        return names.pop(), still + [t.replica for t in router.replicas.evaluate(clock.now) if not t.in_rotation]

    chosen, ejected = asyncio.run(run())
    assert ejected == [chosen]  # only after the answers that came from elsewhere


def test_one_retried_answer_does_not_eject() -> None:
    book = ReplicaBook([Replica("a", "127.0.0.1:1")])
    book.observe("a", 0, None, 0.0)
    book.observe("a", 200, 0.1, 0.1)
    assert all(r.rotation.in_rotation for r in book.records())
