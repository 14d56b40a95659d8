"""Explain (a decision with its trace, without side effects), cordons and drains, in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.app.router import Router
from extproc.request.features import RequestFeatures
from extproc.routing import (
    SCORES_PROFILE,
    AffinityView,
    DecisionInputs,
    Reason,
    Replica,
    ReplicaState,
    Snapshot,
    build_profile,
    decide,
)
from extproc.routing.cordon import FULL
from extproc.routing.trace import DecisionTrace
from tests.conftest import chat_body, make_config
from tests.helpers import Clock, chat_request, conversation, feed, kv_router, metric_value, stored_event

CHAT = "/v1/chat/completions"


def _headers(session: str) -> dict[str, str]:
    return {":path": CHAT, "x-session-id": session}


def _snapshot(n: int = 4, **states: dict[str, object]) -> Snapshot:
    return Snapshot(
        tuple(ReplicaState(Replica(f"r{i}", f"127.0.0.1:{9000 + i}"), **states.get(f"r{i}", {})) for i in range(n))  # type: ignore[arg-type]
    )


def test_the_trace_adds_up_to_the_decision() -> None:
    snap = _snapshot(4, r1={"in_rotation": False, "health": 0.2}, r3={"kv_usage": 0.99, "queue": 20})
    features = RequestFeatures(path=CHAT, model="m", session_key="s", prefix_hashes=tuple(range(10)))
    view = AffinityView(prefix_matches={"r2": 6})
    profile = build_profile(SCORES_PROFILE)  # its overload filter and weighed scorers
    trace = DecisionTrace()
    traced = decide(DecisionInputs.of(features, snap, view, 0.0, profile), trace=trace)
    plain = decide(DecisionInputs.of(features, snap, view, 0.0, profile))
    assert traced == plain
    removed = trace.removed_by()
    assert removed["r1"][0] == "in_rotation" and "health 0.20" in removed["r1"][1]
    assert (
        removed["r3"][0] == "overload"
        and "kv usage 0.99" in removed["r3"][1]
        and "20.0 requests waiting" in removed["r3"][1]
    )
    assert trace.order[0] == plain.replica.name == "r2"  # type: ignore[union-attr]
    for name, total in trace.totals.items():
        parts = sum(s.weight * s.raw.get(name, 0.0) for s in trace.scorers)
        assert abs(parts - total) < 1e-9
        assert all(0.0 <= s.raw.get(name, 0.0) <= 1.0 for s in trace.scorers)


def test_a_cordoned_replica_keeps_its_pinned_session_and_takes_no_new_one() -> None:
    snap, profile = _snapshot(2), build_profile()
    pinned = RequestFeatures(path=CHAT, model="m", session_key="old")
    fresh = [RequestFeatures(path=CHAT, model="m", session_key=f"new-{i}") for i in range(50)]
    cordons = {"r0": "cordoned"}
    assert (
        decide(DecisionInputs.of(pinned, snap, AffinityView(pinned="r0"), 0.0, profile, cordons=cordons)).replica.name
        == "r0"
    )  # type: ignore[union-attr]
    assert {decide(DecisionInputs.of(f, snap, AffinityView(), 0.0, profile)).replica.name for f in fresh} == {
        "r0",
        "r1",
    }  # type: ignore[union-attr]
    assert {
        decide(DecisionInputs.of(f, snap, AffinityView(), 0.0, profile, cordons=cordons)).replica.name for f in fresh
    } == {"r1"}  # type: ignore[union-attr]
    prefix = AffinityView(prefix_matches={"r0": 9})
    assert decide(DecisionInputs.of(fresh[0], snap, prefix, 0.0, profile, cordons=cordons)).replica.name == "r1"  # type: ignore[union-attr]


def test_a_drained_replica_loses_even_its_pinned_sessions_and_all_cordoned_fails_open() -> None:
    snap, profile = _snapshot(2), build_profile()
    pinned = RequestFeatures(path=CHAT, model="m", session_key="old")
    d = decide(DecisionInputs.of(pinned, snap, AffinityView(pinned="r0"), 0.0, profile, cordons={"r0": "drained"}))
    assert d.replica.name == "r1" and d.reason is Reason.FAILOVER  # type: ignore[union-attr]
    everything = {"r0": "cordoned", "r1": "cordoned"}
    trace = DecisionTrace()
    assert (
        decide(DecisionInputs.of(pinned, snap, AffinityView(), 0.0, profile, cordons=everything), trace=trace).replica
        is not None
    )
    assert trace.filters[0].filter == "cordon" and trace.filters[0].failed_open


async def test_explain_pins_counts_and_indexes_nothing() -> None:
    router = Router(make_config())
    body = chat_body("a long shared system prompt " * 40)
    await router.route(_headers("warm"), body)  # a prefix to match, a pin to read
    sessions, blocks = router.store.stats(), metric_value(router.metrics.prefix_blocks)
    inflight = [r.inflight for r in router.replicas.records()]
    ledger = len(router.rebalancer.ledger)
    decisions = sum(s.value for m in router.metrics.decisions.collect() for s in m.samples)
    explained = await router.explain(_headers("new-session"), body)
    assert explained.decision.replica is not None
    assert router.store.stats() == sessions
    assert metric_value(router.metrics.prefix_blocks) == blocks
    assert [r.inflight for r in router.replicas.records()] == inflight
    assert len(router.rebalancer.ledger) == ledger
    assert sum(s.value for m in router.metrics.decisions.collect() for s in m.samples) == decisions
    assert (await router.store.peek("new-session", (), router.clock(), model="m")).pinned is None
    # ... and it agrees with where the request then goes.
    routed = await router.route(_headers("new-session"), body)
    assert routed.decision.replica == explained.decision.replica
    assert explained.decision.matched_blocks > 0 and explained.trace.order[0] == routed.decision.replica.name  # type: ignore[union-attr]
    holder = routed.decision.replica.name  # type: ignore[union-attr]
    assert explained.uncached_tokens[holder] < max(explained.uncached_tokens.values())


async def test_explain_names_a_match_only_requests_in_flight_give_as_in_flight() -> None:
    router = Router(make_config())
    body = chat_body("a long shared system prompt " * 40)
    routed = await router.route(_headers("warm"), body)
    holder = routed.decision.replica.name  # type: ignore[union-attr]
    assert (await router.explain(_headers("other"), body)).match_sources[holder] == "estimate"
    router.store.set_capacity(holder, 1)  # the index keeps one block of it; the request still runs
    await router.route(_headers("filler"), chat_body("something else entirely " * 40))
    explained = await router.explain(_headers("other"), body)
    assert explained.match_sources[holder] == "in_flight" and explained.decision.replica.name == holder  # type: ignore[union-attr]
    assert len(router.caches.inflight) >= 1
    router.release(routed)
    assert (await router.explain(_headers("other"), body)).match_sources.get(holder, "estimate") == "estimate"


async def test_drain_moves_the_sessions_it_knows_and_stops_new_work() -> None:
    router = Router(make_config())
    targets = {}
    for i in range(12):
        routed = await router.route(_headers(f"s{i}"), chat_body(f"conversation {i}"))
        targets[f"s{i}"] = routed.decision.replica.name  # type: ignore[union-attr]
        router.release(routed)
    victim = max(set(targets.values()), key=list(targets.values()).count)
    moved = await router.fleet.set_cordon(victim, "drained")
    assert moved == list(targets.values()).count(victim)
    for session, before in targets.items():
        again = await router.route(_headers(session), chat_body(f"conversation {session[1:]}"))
        assert again.decision.replica.name != victim  # type: ignore[union-attr]
        if before != victim:
            assert again.decision.reason is Reason.STICKY
    assert await router.store.cordons() == {victim: "drained"}
    await router.fleet.set_cordon(victim, None)
    assert router.cordons == {}


async def test_explain_names_kv_events_as_the_source_where_a_feed_is_live(tokenizer_dir: Path) -> None:
    from extproc.adapters.admin.fleet import fleet
    from extproc.adapters.admin.service import explanation_message
    from extproc.request.tokenizer import PromptTokenizer

    clock = Clock(1000.0)
    router, kv = kv_router(tokenizer_dir, clock)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(3, seed=7)
    await feed(kv, "r0", 0, stored_event(tok, conversation(1, seed=31)))  # live, unrelated blocks
    await feed(kv, "r2", 0, stored_event(tok, msgs))  # live, holds the prompt
    explained = await router.explain(*chat_request(msgs))
    reply = explanation_message(explained)
    by_name = {r.replica: r for r in reply.replicas}
    assert reply.replica == "r2" and by_name["r2"].match_source == "kv_events"
    assert by_name["r2"].matched_blocks == reply.total_blocks > 0
    assert by_name["r2"].predicted_uncached_tokens < by_name["r1"].predicted_uncached_tokens
    states = {r.name: r.kv_events for r in fleet(router)}
    assert states == {"r0": "live", "r1": "none", "r2": "live"}
    routed = await router.route(*chat_request(msgs))
    assert routed.decision.replica is not None and routed.decision.replica.name == reply.replica


async def test_explain_shows_each_replicas_trust_and_the_age_of_its_evidence() -> None:
    now = [100.0]
    router = Router(make_config(), clock=lambda: now[0])
    router.caches.estimate.observe("r0", 0.0, 0.0, now=100.0)  # a baseline
    router.caches.estimate.claimed("r0", 1000, 1000)
    router.caches.estimate.observe("r0", 0.0, 1000.0, now=100.0)  # it counted, and found nothing
    now[0] = 130.0
    explained = await router.explain(_headers("s"), chat_body("a prompt " * 40))
    evidence = explained.evidence
    assert evidence["r0"].evidence_age_s == pytest.approx(30.0) and evidence["r1"].evidence_age_s is None
    assert evidence["r0"].kv_events == "" and evidence["r1"].trust == 1.0


async def test_explain_shows_each_candidates_price_and_its_parts() -> None:
    from extproc.adapters.admin.service import explanation_message
    from extproc.adapters.admin.tables import render
    from extproc.routing.registry import PRICE_PROFILE

    router = Router(make_config(profile=PRICE_PROFILE))
    body = chat_body("a long shared system prompt " * 40)
    routed = await router.route(_headers("warm"), body)
    holder = routed.decision.replica.name  # type: ignore[union-attr]
    explained = await router.explain(_headers("warm"), body)
    prices = explained.trace.prices
    assert set(prices) == set(explained.trace.totals)  # every candidate is priced
    assert explained.decision.replica.name == holder == min(prices, key=lambda n: prices[n].total_s)  # type: ignore[union-attr]
    # The holder's prefill is the turn's new part only; elsewhere the whole prompt, and a move.
    other = next(n for n in prices if n != holder)
    assert prices[holder].prefill_s < prices[other].prefill_s and prices[other].move_s > 0
    message = explanation_message(explained)
    by_name = {r.replica: r for r in message.replicas}
    assert by_name[holder].price_s == pytest.approx(prices[holder].total_s)
    parts = {p.part: p.seconds for p in by_name[other].price_parts}
    assert set(parts) == {"overhead", "adapter", "prefill", "queue", "kv_wait", "others", "future", "move"}
    assert sum(parts.values()) == pytest.approx(by_name[other].price_s)  # the parts make the price
    assert by_name[other].price_ttft_s == pytest.approx(
        sum(parts[k] for k in ("overhead", "adapter", "prefill", "queue", "kv_wait"))
    )
    assert by_name[holder].price_rates == "prior"
    assert "price " in render("explain", message) and "ttft " in render("explain", message)


def test_a_replica_full_for_new_conversations_keeps_its_pinned_ones_and_explain_says_why() -> None:
    snap, profile = _snapshot(2), build_profile()
    full = {"r0": FULL}
    pinned = RequestFeatures(path=CHAT, model="m", session_key="old")
    stays = decide(DecisionInputs.of(pinned, snap, AffinityView(pinned="r0"), 0.0, profile, cordons=full))
    assert stays.replica is not None and stays.replica.name == "r0"
    trace = DecisionTrace()
    fresh = RequestFeatures(path=CHAT, model="m", session_key="new")
    d = decide(DecisionInputs.of(fresh, snap, AffinityView(), 0.0, profile, cordons=full), trace=trace)
    assert d.replica.name == "r1"  # type: ignore[union-attr]
    assert trace.filters[0].removed == [("r0", "no KV room for a new conversation now (queueing.kv_room)")]


def test_a_full_mark_keeps_a_pinned_conversation_no_more_once_its_replica_lost_it() -> None:
    snap, profile = _snapshot(2), build_profile()
    pinned = RequestFeatures(path=CHAT, model="m", session_key="old")
    lost = AffinityView(pinned="r0", pin_lost="kv_events")
    moved = decide(DecisionInputs.of(pinned, snap, lost, 0.0, profile, cordons={"r0": FULL}))
    assert moved.replica is not None and moved.replica.name == "r1"
    stays = decide(DecisionInputs.of(pinned, snap, lost, 0.0, profile, cordons={"r0": "cordoned"}))
    assert stays.replica is not None and stays.replica.name == "r0"  # an operator's cordon keeps it
