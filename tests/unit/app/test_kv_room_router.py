"""KV room in the router (``queueing.kv_room``): a new conversation goes where there is room for
it, and with room nowhere is decided once a replica has it, on that replica."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from extproc.app.router import Routed, Router
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.fleet.queueing.settings import QueueSettings
from extproc.request.conversation import ConversationChain
from extproc.request.features import RequestFeatures
from extproc.routing import Replica
from extproc.routing.model import AffinityView, Decision, Reason
from extproc.routing.pipeline import DecisionInputs
from extproc.routing.trace import DecisionTrace
from tests.conftest import chat_body, make_config

# 128 blocks of 16 tokens: 2,048 tokens, where one ~1,500-token prompt fits and two do not.
PROMPT = "word " * 1200  # 6,000 characters: about 1,500 tokens


def r0_first(given: DecisionInputs, trace: DecisionTrace | None = None) -> Decision:
    """Always r0 unless it is marked (cordoned, or full for a new conversation): the decision a
    request would get on arrival whatever becomes free first."""
    states = {s.name: s for s in given.snapshot.replicas}
    marks = given.cordons or {}
    open_ = [n for n in sorted(states) if n not in marks] or sorted(states)
    return Decision(states[open_[0]].replica, Reason.NEW_SESSION)


def _router(max_wait_s: float) -> Router:
    replicas = (Replica("r0", "10.0.0.1:80"), Replica("r1", "10.0.0.2:80"))
    queueing = QueueSettings(kv_room=True, kv_room_grace_s=0.0, kv_room_max_wait_s=max_wait_s)
    router = Router(make_config(replicas=replicas, queueing=queueing), decider=r0_first)
    for r in replicas:
        router.replicas.apply_scrape(r.name, ReplicaMetrics(num_gpu_blocks=128, block_size=16), router.clock())
    return router


async def _route(router: Router, session: str, seed: int) -> Routed:
    body = chat_body(f"{seed} " + PROMPT, max_tokens=16)
    return await router.route({":path": "/v1/chat/completions", "x-session-id": session}, body)


def _on(routed: Routed) -> str:
    assert routed.decision.replica is not None
    return routed.decision.replica.name


async def test_a_new_conversation_is_decided_on_the_replica_that_frees_room_first() -> None:
    router = _router(max_wait_s=5.0)
    a = await _route(router, "a", 1)
    headers = {":path": "/v1/chat/completions", "x-session-id": "b"}
    explained = await router.explain(headers, chat_body("2 " + PROMPT, max_tokens=16))
    assert explained.decision.replica is not None and explained.decision.replica.name == "r1"  # as route() will
    b = await _route(router, "b", 2)
    assert (_on(a), _on(b)) == ("r0", "r1")  # r0 full for b: it went where there was room
    c = asyncio.ensure_future(_route(router, "c", 3))
    await asyncio.sleep(0.05)  # both full: c waits, decided nowhere yet
    assert not c.done()
    router.release(b)  # r1 frees first
    routed = await asyncio.wait_for(c, 1.0)
    assert _on(routed) == "r1"  # not r0, where it would have been decided on arrival
    view = await router.store.lookup("c", (), router.clock(), model="m")
    assert view.pinned == "r1"
    router.release(routed)
    router.release(a)
    assert router.room is not None and router.room.gate.room.waiting() == 0


async def test_a_follow_up_waits_for_its_own_replica_and_a_new_conversation_out_of_time_goes_as_decided() -> None:
    router = _router(max_wait_s=0.3)
    a = await _route(router, "a", 1)
    router.release(a)
    await _route(router, "x", 2)  # r0 again: a's room is not kept (grace 0)
    await _route(router, "y", 3)  # r1
    loop = asyncio.get_running_loop()
    started = loop.time()
    follow_up = await _route(router, "a", 1)  # pinned to r0: it waits there, not elsewhere
    assert _on(follow_up) == "r0"
    late = await _route(router, "z", 4)  # no room anywhere until its time is up: sent as decided
    waited = loop.time() - started
    assert _on(late) == "r0"
    assert waited < 0.3 * 2 + 0.25  # each waited its limit once, not twice


async def test_a_conversation_its_replica_lost_is_a_new_one_for_the_room_unless_that_replica_stores_it() -> None:
    router = _router(max_wait_s=5.0)
    await _route(router, "a", 1)  # r0 full for another 1,500 tokens
    now = router.clock()
    features = RequestFeatures(path="/v1/chat/completions", model="m", session_key="b", prompt_chars=6000)
    snapshot, profile = router.replicas.snapshot(now), router.profile

    def marked(view: AffinityView) -> frozenset[str]:
        return router.core.room_marked(DecisionInputs.of(features, snapshot, view, now, profile))[1]

    assert marked(AffinityView()) == {"r0"}  # new: not where there is no room
    assert marked(AffinityView(pinned="r0")) == frozenset()  # its history is there: it waits there
    assert marked(AffinityView(pinned="r0", pin_lost="kv_events")) == {"r0"}  # gone: a new one
    stored = ConversationChain(end=1, turn=None, messages=1, match="continued", stored=True)
    features = replace(features, conversation=stored)
    assert marked(AffinityView(pinned="r0", pin_lost="kv_events")) == frozenset()  # only r0 can answer it


async def test_a_turn_arrives_at_the_room_before_it_is_decided_and_explain_does_not_arrive() -> None:
    replicas = (Replica("r0", "10.0.0.1:80"),)
    queueing = QueueSettings(kv_room=True, kv_room_grace_s=1.0)
    seen: list[float] = []

    def recording(given: DecisionInputs, trace: DecisionTrace | None = None) -> Decision:
        assert router.room is not None
        seen.append(router.room.gate.room.kept_for("a"))  # what the room knows of a at the decision
        return r0_first(given, trace)

    router = Router(make_config(replicas=replicas, queueing=queueing), decider=recording)
    router.replicas.apply_scrape("r0", ReplicaMetrics(num_gpu_blocks=128, block_size=16), router.clock())
    router.release(await _route(router, "a", 1))  # its room kept all of grace: no gap known yet
    headers = {":path": "/v1/chat/completions", "x-session-id": "a"}
    await router.explain(headers, chat_body("1 " + PROMPT, max_tokens=16))
    follow_up = await _route(router, "a", 1)
    assert seen[1] == 1.0  # explain: nothing arrived
    assert seen[2] < 1.0  # the follow-up: its gap was measured before it was decided
    router.release(follow_up)
