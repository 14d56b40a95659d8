"""A disaggregated request through the router and one ext_proc stream, in process: the prefill
replica named to the decode replica's sidecar (and a client's own naming stripped), the hop
counted on the prefill replica until the first byte, the prompt indexed on both replicas, the
metrics, and Explain showing the pair."""

from __future__ import annotations

import asyncio
import json

from extproc.adapters.admin.service import explanation_message
from extproc.adapters.admin.tables import render
from extproc.adapters.server.stream import RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.config import Disaggregation
from extproc.observe.decisions import DecisionSummary
from extproc.observe.tracing import DecisionTracer
from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc.routing.model import Replica
from extproc.routing.roles import ROLE_LABEL, PairReason
from tests.conftest import body_message, headers_message, make_config, response_headers_message
from tests.helpers import Clock, metric_value

CHAT = "/v1/chat/completions"
FLEET = (
    Replica("p0", "127.0.0.1:8100", labels={ROLE_LABEL: "prefill"}),
    Replica("d0", "127.0.0.1:8200", labels={ROLE_LABEL: "decode"}),
)
LONG = "a long document, sentence after sentence. " * 100  # about 1050 tokens


def router() -> Router:
    config = make_config(replicas=FLEET, disaggregation=Disaggregation(weigh_local=False))
    return Router(config, clock=Clock())


def body(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


async def decide(r: Router, text: str, **headers: str) -> RequestStream:
    stream = RequestStream(Planner(r))
    await stream.answer(headers_message({":path": CHAT, "x-session-id": "s", **headers}))
    await stream.answer(body_message(body(text)))
    return stream


def answer_headers(stream: RequestStream) -> tuple[dict[str, str], list[str]]:
    action = stream.plan.action if stream.plan is not None else None
    assert action is not None and not hasattr(action, "status")
    return dict(action.set_headers), list(action.remove_headers)  # type: ignore[union-attr]


def pending(r: Router, name: str) -> int:
    state = r.replicas.snapshot(r.clock()).get(name)
    assert state is not None
    return state.pending_prefill_tokens


def test_a_hop_names_the_prefill_replica_to_the_sidecar_and_is_counted_there_until_the_first_byte() -> None:
    r = router()

    async def run() -> None:
        stream = await decide(r, LONG, **{PREFILLER_HEADER: "10.9.9.9:1"})
        assert stream.plan is not None
        decision = stream.plan.routed.decision
        assert decision.replica == FLEET[1] and decision.prefill == FLEET[0]
        assert decision.pair is PairReason.DISAGGREGATED
        sets, removes = answer_headers(stream)
        assert sets[PREFILLER_HEADER] == "127.0.0.1:8100"  # the client's own value overwritten
        assert PREFILLER_HEADER not in removes
        assert pending(r, "p0") > 1000 and pending(r, "d0") == 0  # the prefill waits where it is made
        # The prompt is known on both replicas: the next request with it matches either.
        view = await r.store.lookup(None, stream.plan.routed.features.prefix_hashes, r.clock())
        assert set(view.prefix_matches) == {"p0", "d0"}
        await stream.answer(response_headers_message(200))
        assert pending(r, "p0") == 0
        r.release(stream.plan.routed)
        assert r.caches.inflight.matches(stream.plan.routed.features.prefix_hashes) == {}

    asyncio.run(run())
    assert metric_value(r.metrics.disagg_decisions.labels("disaggregated")) == 1
    assert metric_value(r.metrics.prefill_hops.labels("p0")) == 1
    assert metric_value(r.metrics.transfer_blocks) > 0


def test_a_client_naming_a_prefill_replica_is_stripped_when_the_router_names_none() -> None:
    r = router()

    async def run() -> None:
        stream = await decide(r, "hello", **{PREFILLER_HEADER: "10.9.9.9:1"})
        assert stream.plan is not None and stream.plan.routed.decision.pair is PairReason.SHORT
        sets, removes = answer_headers(stream)
        assert PREFILLER_HEADER not in sets and PREFILLER_HEADER in removes
        r.release(stream.plan.routed)

    asyncio.run(run())
    assert metric_value(r.metrics.disagg_decisions.labels("short")) == 1
    assert metric_value(r.metrics.prefill_hops.labels("p0")) == 0


def test_a_request_that_ends_before_its_first_byte_frees_the_prefill_replica() -> None:
    r = router()

    async def run() -> None:
        stream = await decide(r, LONG)
        assert stream.plan is not None and pending(r, "p0") > 0
        r.release(stream.plan.routed)
        assert pending(r, "p0") == 0

    asyncio.run(run())


def test_explain_shows_the_pair_and_why() -> None:
    r = router()
    long = asyncio.run(r.explain({":path": CHAT, "x-session-id": "s"}, body(LONG)))
    assert long.decision.prefill == FLEET[0] and long.decision.pair is PairReason.DISAGGREGATED
    reply = explanation_message(long)
    assert (reply.replica, reply.prefill, reply.pair_reason) == ("d0", "p0", "disaggregated")
    assert reply.transfer_blocks == long.decision.transfer_blocks > 0
    assert f"pair disaggregated: decode on d0, prefill on p0, {reply.transfer_blocks} blocks cross" in render(
        "explain", reply
    )
    short = explanation_message(asyncio.run(r.explain({":path": CHAT}, body("hi"))))
    assert (short.prefill, short.pair_reason) == ("", "short")
    assert "pair short: decode on d0, no hop" in render("explain", short)
    assert metric_value(r.metrics.prefill_hops.labels("p0")) == 0  # explained, not routed


def test_a_fleet_without_roles_sets_no_pair_and_strips_the_header() -> None:
    r = Router(make_config(), clock=Clock())

    async def run() -> None:
        stream = await decide(r, LONG, **{PREFILLER_HEADER: "10.9.9.9:1"})
        assert stream.plan is not None and stream.plan.routed.decision.pair is None
        sets, removes = answer_headers(stream)
        assert PREFILLER_HEADER not in sets and PREFILLER_HEADER in removes

    asyncio.run(run())
    assert sum(metric_value(r.metrics.disagg_decisions.labels(p.value)) for p in PairReason) == 0


def test_the_headers_answer_strips_a_clients_prefill_header_before_the_body() -> None:
    async def run() -> list[str]:
        stream = RequestStream(Planner(router()))
        (answer,) = await stream.answer(headers_message({":path": CHAT, PREFILLER_HEADER: "10.9.9.9:1"}))
        return list(answer.request_headers.response.header_mutation.remove_headers)

    assert PREFILLER_HEADER in asyncio.run(run())


def test_the_decision_span_carries_the_pair() -> None:
    r = router()
    hop = asyncio.run(r.explain({":path": CHAT, "x-session-id": "s"}, body(LONG)))
    attrs = DecisionTracer._attributes(hop.features, hop.decision, 2, "default")
    assert attrs["extproc.pair"] == "disaggregated" and attrs["extproc.prefill.replica"] == "p0"
    assert attrs["extproc.prefill.transfer_blocks"] == hop.decision.transfer_blocks
    short = asyncio.run(r.explain({":path": CHAT}, body("hi")))
    attrs = DecisionTracer._attributes(short.features, short.decision, 2, "default")
    assert attrs["extproc.pair"] == "short" and "extproc.prefill.replica" not in attrs


def test_the_decision_feed_and_the_fleet_carry_pairs_and_roles() -> None:
    from extproc.adapters.admin.fleet import fleet

    r = router()

    async def watched() -> list[DecisionSummary]:
        seen: list[DecisionSummary] = []
        watch = r.feed.watch(1.0)
        first = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0)  # the watcher is registered
        await decide(r, LONG)
        seen.append(await first)
        await decide(r, "hi")
        seen.append(await anext(watch))
        await watch.aclose()
        return seen

    long, short = asyncio.run(watched())
    assert (long.replica, long.prefill, long.pair_reason) == ("d0", "p0", "disaggregated")
    assert (short.replica, short.prefill, short.pair_reason) == ("d0", "", "short")
    assert {row.name: row.role for row in fleet(r)} == {"p0": "prefill", "d0": "decode"}
    aggregated = Router(make_config(replicas=(Replica("a", "127.0.0.1:1"),)), clock=Clock())
    assert [row.role for row in fleet(aggregated)] == ["both"]
