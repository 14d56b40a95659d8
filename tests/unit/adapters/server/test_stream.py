"""One ext_proc stream as a state machine, driven in memory (no sockets)."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.server.stream import Phase, RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.config import with_overrides
from tests.conftest import (
    body_message,
    chat_body,
    headers_message,
    make_config,
    response_headers_message,
    set_headers,
)
from tests.helpers import metric_value, run

CHAT = {":path": "/v1/chat/completions", ":method": "POST"}


async def test_body_phase_carries_the_decision_in_cluster_mode() -> None:
    router = Router(make_config())
    out = await run(
        router,
        [
            headers_message({**CHAT, "x-session-id": "s", "x-target-cluster": "evil"}),
            body_message(chat_body("hello")),
            response_headers_message(200),
        ],
    )
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "response_headers"]
    assert "x-target-cluster" in out[0].request_headers.response.header_mutation.remove_headers
    common = out[1].request_body.response
    assert common.clear_route_cache
    assert set_headers(common.header_mutation)["x-target-cluster"] in {"r0", "r1", "r2"}
    assert all(r.inflight == 0 for r in router.replicas.records())  # released at the end of the stream


async def test_endpoint_mode_sets_header_and_lb_metadata_with_fallbacks() -> None:
    router = Router(make_config(mode="endpoint"))
    out = await run(router, [headers_message(CHAT), body_message(chat_body("hello"))])
    common = out[1].request_body.response
    endpoint = set_headers(common.header_mutation)["x-gateway-destination-endpoint"]
    chain = out[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    addresses = chain.string_value.split(",")
    assert addresses[0] == endpoint and len(addresses) == 3 and len(set(addresses)) == 3


async def test_request_without_body_is_routed_in_the_headers_phase() -> None:
    out = await run(Router(make_config()), [headers_message({":path": "/v1/models", ":method": "GET"}, True)])
    common = out[0].request_headers.response
    assert common.clear_route_cache and "x-target-cluster" in set_headers(common.header_mutation)


async def test_session_turns_stay_on_one_replica() -> None:
    router = Router(make_config())
    chosen = set()
    for turn in range(20):
        out = await run(
            router, [headers_message({**CHAT, "x-session-id": "conv"}), body_message(chat_body(f"t{turn}"))]
        )
        chosen.add(set_headers(out[1].request_body.response.header_mutation)["x-target-cluster"])
    assert len(chosen) == 1


async def test_partial_body_chunks_are_accumulated() -> None:
    router = Router(make_config())
    body = chat_body("a" * 1000)
    out = await run(
        router,
        [headers_message({**CHAT, "x-session-id": "s"}), body_message(body[:100], False), body_message(body[100:])],
    )
    assert out[1].request_body.response.header_mutation.set_headers == []
    assert set_headers(out[2].request_body.response.header_mutation)["x-target-cluster"]
    assert metric_value(router.metrics.body_errors) == 0


async def test_malformed_and_huge_bodies_are_routed_by_fallback() -> None:
    router = Router(make_config())
    for body in (b"{nope", b"", b"\x00\xff" * 10, chat_body("x" * (9 * 1024 * 1024))):
        out = await run(router, [headers_message({**CHAT, "x-session-id": "s"}), body_message(body)])
        assert set_headers(out[-1].request_body.response.header_mutation)["x-target-cluster"]
    assert metric_value(router.metrics.body_errors) == 4


async def test_no_replicas_lets_envoy_route_on_its_own() -> None:
    router = Router(make_config(replicas=()))
    out = await run(router, [headers_message(CHAT), body_message(chat_body("x"))])
    assert out[1].WhichOneof("response") == "request_body"
    assert not out[1].request_body.response.header_mutation.set_headers
    assert metric_value(router.metrics.decisions.labels("no_replica", "m")) == 1


async def test_messages_out_of_order_are_let_through() -> None:
    router = Router(make_config())
    out = await run(
        router,
        [
            body_message(b"early"),
            response_headers_message(200),
            headers_message(CHAT),
            headers_message(CHAT),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            pb.ProcessingRequest(),
        ],
    )
    assert len(out) == 6
    assert out[0].WhichOneof("response") == "request_body"
    assert out[4].WhichOneof("response") == "request_trailers"


async def test_a_failing_router_never_fails_the_stream() -> None:
    router = Router(make_config())

    async def broken(*_: object) -> None:
        raise RuntimeError("boom")

    router.route = broken  # type: ignore[method-assign,assignment]
    out = await run(router, [headers_message(CHAT), body_message(chat_body("x"))])
    assert out[1].WhichOneof("response") == "request_body"
    assert not out[1].request_body.response.header_mutation.set_headers


async def test_upstream_failures_take_a_replica_out_of_rotation() -> None:
    clock = [0.0]
    router = Router(make_config(), clock=lambda: clock[0])
    for _ in range(3):
        await run(
            router,
            [
                headers_message({**CHAT, "x-session-id": "s"}),
                body_message(chat_body("x")),
                response_headers_message(503),
            ],
        )
    snap = router.replicas.snapshot(clock[0])
    assert sum(not s.in_rotation for s in snap.replicas) == 1
    clock[0] += 60  # past the cooldown: readmitted after two good evaluations, not before
    router.replicas.evaluate(clock[0])
    assert sum(not s.in_rotation for s in router.replicas.snapshot(clock[0]).replicas) == 1
    router.replicas.evaluate(clock[0] + 0.25)
    assert all(s.in_rotation for s in router.replicas.snapshot(clock[0]).replicas)


async def test_membership_changes_join_and_leave() -> None:
    from extproc.routing import Replica

    router = Router(make_config())
    await run(router, [headers_message({**CHAT, "x-session-id": "s"}), body_message(chat_body("x" * 500))])
    pinned = (await router.store.lookup("s", (), 0.0, model="m")).pinned
    assert pinned is not None
    keep = [r for r in router.config.replicas if r.name != pinned]
    change = await router.fleet.set_replicas([*keep, Replica("new", "10.9.9.9:8000")])
    assert change.joined == ("new",) and change.left == (pinned,)
    assert pinned not in router.replicas and "new" in router.replicas
    out = await run(router, [headers_message({**CHAT, "x-session-id": "s"}), body_message(chat_body("x" * 500))])
    assert set_headers(out[1].request_body.response.header_mutation)["x-target-cluster"] != pinned


async def test_full_duplex_holds_the_headers_answer_and_streams_the_body_back() -> None:
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    router = Router(make_config())
    body = chat_body("y" * 100_000)
    first = headers_message({**CHAT, "x-session-id": "s"})
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    out = await run(
        router,
        [
            first,
            body_message(body[:70_000], False),
            body_message(body[70_000:], False),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        ],
    )
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    assert set_headers(out[0].request_headers.response.header_mutation)["x-target-cluster"]
    streamed = [r.request_body.response.body_mutation.streamed_response for r in out[1:-1]]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]


async def test_response_sampling_skips_the_response_headers_of_the_unsampled_requests() -> None:
    """health.response_sample_rate 0.25: every fourth request keeps its response-headers phase;
    the others are told (mode_override, repeating the buffered body mode) to skip it."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

    cfg = make_config()
    router = Router(with_overrides(cfg, health=cfg.health.model_copy(update={"response_sample_rate": 0.25})))
    overrides = []
    for i in range(8):
        out = await run(router, [headers_message({**CHAT, "x-session-id": f"s{i}"}), body_message(chat_body("hi"))])
        overrides.append(out[0].HasField("mode_override"))
        if out[0].HasField("mode_override"):
            mode = out[0].mode_override
            assert mode.response_header_mode == pm.ProcessingMode.SKIP
            assert mode.request_body_mode == pm.ProcessingMode.BUFFERED  # the body still comes
            assert "x-target-cluster" in out[0].request_headers.response.header_mutation.remove_headers
        assert out[1].request_body.response.clear_route_cache  # routed either way
    assert overrides == [True, True, True, False] * 2
    assert all(r.inflight == 0 for r in router.replicas.records())


async def test_by_default_every_response_is_observed() -> None:
    router = Router(make_config())
    out = await run(router, [headers_message(CHAT), body_message(chat_body("hi"))])
    assert not out[0].HasField("mode_override")


def _duplex(headers: dict[str, str]) -> pb.ProcessingRequest:
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    first = headers_message(headers)
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return first


async def test_a_failing_router_in_full_duplex_releases_the_held_back_request_unrouted() -> None:
    router = Router(make_config())

    async def broken(*_: object) -> None:
        raise RuntimeError("boom")

    router.route = broken  # type: ignore[method-assign,assignment]
    body = chat_body("z" * 100)
    out = await run(
        router,
        [
            _duplex(CHAT),
            body_message(body[:50], False),
            body_message(body[50:], False),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
        ],
    )
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    assert not out[0].request_headers.response.header_mutation.set_headers  # unrouted: Envoy's default route
    assert out[1].request_body.response.body_mutation.streamed_response.body == body
    assert metric_value(router.metrics.stream_errors.labels("answer")) == 1


async def test_the_phases_of_a_buffered_request_and_of_a_full_duplex_one() -> None:
    router = Router(make_config())
    stream = RequestStream(Planner(router))
    seen = []
    for message in (
        headers_message(CHAT),
        body_message(b"{", False),
        body_message(chat_body("x")),
        response_headers_message(200),
    ):
        await stream.answer(message)
        seen.append(stream.phase)
    assert seen == [Phase.REQUEST_BODY, Phase.REQUEST_BODY, Phase.RESPONSE_HEADERS, Phase.DONE]
    duplex = RequestStream(Planner(router))
    answers = [await duplex.answer(m) for m in (_duplex(CHAT), body_message(b"{", False), body_message(b"}", True))]
    assert [len(a) for a in answers] == [0, 0, 2]  # held back, then the decision and the body
    assert duplex.phase is Phase.RESPONSE_HEADERS
    assert duplex.plan is not None
    router.release(duplex.plan.routed)


async def test_a_message_out_of_its_phase_is_let_through_and_changes_nothing() -> None:
    router = Router(make_config())
    out = await run(
        router,
        [
            headers_message(CHAT),
            body_message(chat_body("x")),
            response_headers_message(200),
            response_headers_message(503),
        ],
    )
    assert [r.WhichOneof("response") for r in out][-1] == "response_headers"
    assert metric_value(router.metrics.responses_observed) == 1  # the second is not a response of its own


async def test_the_plan_says_where_and_the_refusal_wording_is_the_planners() -> None:
    from extproc.app.plan import QUOTA_MESSAGE, Forward, Refuse
    from extproc.config import config_from_mapping

    planner = Planner(Router(make_config(mode="endpoint")))
    plan = await planner.plan({**CHAT, "x-session-id": "s"}, chat_body("x"))
    action = plan.action
    assert isinstance(action, Forward) and action.to_replica and action.body is None
    endpoint = dict(action.set_headers)["x-gateway-destination-endpoint"]
    assert action.lb_metadata[0][1].split(",")[0] == endpoint
    assert "x-gateway-destination-endpoint" not in action.remove_headers
    planner.end(plan)
    unrouted = await Planner(Router(make_config(replicas=()))).plan(CHAT, chat_body("x"))
    assert unrouted.action == Forward((), Router(make_config()).config.routing_headers)
    quota = {"trust_header": True, "definitions": {"t": {"max_concurrent": 1, "retry_after_s": 3}}}
    replicas = [{"name": "r0", "address": "10.0.0.1:8000"}]
    planner = Planner(
        Router(config_from_mapping({"replicas": replicas, "metrics": {"enabled": False}, "tenants": quota}))
    )
    held = await planner.plan({**CHAT, "x-tenant-id": "t"}, chat_body("x"))
    refused = await planner.plan({**CHAT, "x-tenant-id": "t"}, chat_body("y"))
    assert refused.action == Refuse(429, QUOTA_MESSAGE, "quota_exceeded", 3)
    planner.end(held)
