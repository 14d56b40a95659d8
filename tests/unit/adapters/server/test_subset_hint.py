"""The gateway's subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``):
read from the stream's metadata, candidates restricted to it (fallbacks too), 503 when it offers
no ready replica, never set by a client, and shown by Explain."""

from __future__ import annotations

from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.server.subset_hint import subset_hint
from extproc.app.router import Router
from extproc.request.subset import SUBSET_KEY, decode_subset, in_subset
from extproc.routing.pipeline import SUBSET_STEP
from tests.conftest import body_message, chat_body, headers_message, make_config, set_headers
from tests.helpers import run

CHAT = {":path": "/v1/chat/completions", ":method": "POST"}
ENDPOINT = "x-gateway-destination-endpoint"


def with_hint(message: pb.ProcessingRequest, value: Any) -> pb.ProcessingRequest:
    """``message`` with the subset hint in its metadata, as Envoy forwards the namespace."""
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": value})
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def chosen(out: list[pb.ProcessingResponse]) -> tuple[str, list[str]]:
    """The endpoint a routed stream was sent to, and the whole chain in the envoy.lb metadata."""
    common = out[1].request_body.response
    chain = out[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields[ENDPOINT].string_value
    return set_headers(common.header_mutation)[ENDPOINT], chain.split(",")


def test_the_hint_is_read_from_the_metadata_in_its_shapes() -> None:
    assert subset_hint(headers_message(CHAT)) is None
    assert subset_hint(with_hint(headers_message(CHAT), ["10.0.0.1:8000", "10.0.0.2:8000"])) == (
        "10.0.0.1:8000,10.0.0.2:8000"
    )
    assert subset_hint(with_hint(headers_message(CHAT), "10.0.0.1:8000, 10.0.0.2:8000")) == (
        "10.0.0.1:8000,10.0.0.2:8000"
    )
    assert subset_hint(with_hint(headers_message(CHAT), [])) == ""
    assert subset_hint(with_hint(headers_message(CHAT), 7)) == ""  # not a list: offers nothing
    other = headers_message(CHAT)
    other.metadata_context.filter_metadata["envoy.lb"].update({"x": "y"})
    assert subset_hint(other) is None
    assert decode_subset("10.0.0.1:8000,[fd00::0001]:8000, 10.0.0.3") == frozenset(
        {"10.0.0.1:8000", "[fd00::1]:8000", "10.0.0.3"}
    )
    assert in_subset("10.0.0.3:8001", frozenset({"10.0.0.3"}))  # a bare IP offers its ports
    assert not in_subset("10.0.0.3:8001", frozenset({"10.0.0.3:8000"}))


async def test_only_the_offered_endpoints_are_picked_fallbacks_included() -> None:
    router = Router(make_config(mode="endpoint"))
    free, _ = chosen(await run(router, [headers_message(CHAT), body_message(chat_body("hello"))]))
    offered = sorted({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"} - {free})
    for _ in range(10):
        out = await run(router, [with_hint(headers_message(CHAT), offered), body_message(chat_body("hello"))])
        endpoint, chain = chosen(out)
        assert endpoint in offered and chain[0] == endpoint and set(chain) == set(offered)
    # One offered: that one, whatever the scores say, and no fallback outside it.
    out = await run(router, [with_hint(headers_message(CHAT), ["10.0.0.3:8000"]), body_message(chat_body("x"))])
    assert chosen(out) == ("10.0.0.3:8000", ["10.0.0.3:8000"])


async def test_a_hint_that_offers_no_ready_replica_is_answered_503() -> None:
    router = Router(make_config(mode="endpoint"))
    for offered in ([], ["10.9.9.9:8000"]):
        out = await run(router, [with_hint(headers_message(CHAT), offered), body_message(chat_body("hello"))])
        assert out[-1].WhichOneof("response") == "immediate_response"
        answer = out[-1].immediate_response
        assert answer.status.code == 503 and b"subset hint" in answer.body
    assert all(r.inflight == 0 for r in router.replicas.records())


async def test_a_client_cannot_set_the_subset() -> None:
    router = Router(make_config(mode="endpoint"))
    for _ in range(6):
        out = await run(router, [headers_message({**CHAT, SUBSET_KEY: "10.9.9.9:8000"}), body_message(chat_body("a"))])
        assert out[1].WhichOneof("response") == "request_body"  # routed, not refused
        assert chosen(out)[0] in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    # ... nor widen one the gateway gave.
    hinted = with_hint(headers_message({**CHAT, SUBSET_KEY: "10.0.0.1:8000,10.0.0.2:8000"}), ["10.0.0.3:8000"])
    assert chosen(await run(router, [hinted, body_message(chat_body("a"))]))[0] == "10.0.0.3:8000"


async def test_a_pinned_session_moved_by_the_hint_says_so_and_explain_shows_the_step() -> None:
    router = Router(make_config(mode="endpoint"))
    session = {**CHAT, "x-session-id": "conversation"}
    home, _ = chosen(await run(router, [headers_message(session), body_message(chat_body("turn 1"))]))
    elsewhere = sorted({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"} - {home})
    routed = await router.route({**session, SUBSET_KEY: ",".join(elsewhere)}, chat_body("turn 2"))
    assert routed.decision.replica is not None and routed.decision.replica.address in elsewhere
    assert routed.decision.moved_by == SUBSET_STEP
    router.release(routed)
    explained = await router.explain({**session, SUBSET_KEY: ",".join(elsewhere)}, chat_body("turn 3"))
    steps = {step.filter: step for step in explained.trace.filters}
    assert [name for name, _ in steps[SUBSET_STEP].removed] == [
        r.replica.name for r in router.replicas.records() if r.replica.address == home
    ]
    assert "subset hint" in steps[SUBSET_STEP].removed[0][1]


async def test_an_inference_pools_picker_without_a_ready_endpoint_answers_503() -> None:
    cfg = make_config(mode="endpoint", replicas=(), discovery={"type": "inference_pool", "name": "vllm"})
    out = await run(Router(cfg), [headers_message(CHAT), body_message(chat_body("hello"))])
    answer = out[-1].immediate_response
    assert answer.status.code == 503 and b"no ready endpoint" in answer.body
    # Elsewhere an empty fleet still goes down Envoy's own route.
    out = await run(Router(make_config(mode="endpoint", replicas=())), [headers_message(CHAT), body_message(b"{}")])
    assert out[-1].WhichOneof("response") == "request_body"
