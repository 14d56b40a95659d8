"""A new conversation placed by its whole cost: the conversations each replica already carries."""

from __future__ import annotations

import copy

from extproc.config import Config
from extproc.fleet.health.sessions import LiveSessions
from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.registry import DEFAULT_PROFILE
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import shared_system_chat
from extproc_lab.sim.simulator import Simulation


def test_a_session_is_live_while_streaming_and_for_a_while_after_its_turn_began() -> None:
    live = LiveSessions(live_s=10.0)
    live.begin("r0", "a", 0.0)
    live.begin("r0", "b", 1.0)
    live.end("b")
    assert live.counts(5.0) == {"r0": 2}
    assert live.counts(10.5) == {"r0": 2}  # a's turn still streams, b's began 9.5 s ago
    assert live.counts(11.5) == {"r0": 1}  # b expired; a is in flight
    live.end("a")
    assert live.counts(30.0) == {}
    assert len(live) == 0
    # A session that moves is counted where its last turn went.
    live.begin("r0", "c", 40.0)
    live.end("c")
    live.begin("r1", "c", 41.0)
    assert live.counts(41.0) == {"r1": 1}
    live.forget("r1")
    assert live.counts(41.0) == {} and len(live) == 0


def test_live_sessions_are_bounded() -> None:
    live = LiveSessions(live_s=1e9, max_sessions=100)
    for i in range(1000):
        live.begin(f"r{i % 4}", f"s{i}", float(i))
        live.end(f"s{i}")
    assert len(live) == 100 and sum(live.counts(1000.0).values()) == 100


def whole_cost_profile() -> dict[str, object]:
    """The default profile with a new conversation placed by its whole cost (``session_tokens``)."""
    spec = copy.deepcopy(dict(DEFAULT_PROFILE))
    for scorer in spec["scorers"]:  # type: ignore[attr-defined]
        if scorer["type"] == "prefill_cost":
            scorer["parameters"] = {"session_tokens": 512}
    return spec


def new_conversation_goes_to(r0_live: int, pinned: str | None = None) -> str:
    """Where a new conversation goes when every conversation shares a long system prompt that r0
    holds, r0 carries ``r0_live`` conversations and r1, which does not hold it, none."""
    features = RequestFeatures(
        path="/v1/chat/completions", model="m", session_key="new", prefix_hashes=tuple(range(40)), prompt_chars=40 * 64
    )
    replicas = (
        ReplicaState(Replica("r0", "h:0"), live_sessions=r0_live),
        ReplicaState(Replica("r1", "h:1"), live_sessions=0),
    )
    view = AffinityView(pinned=pinned, prefix_matches={"r0": 32})
    d = decide(DecisionInputs.of(features, Snapshot(replicas), view, 0.0, build_profile(whole_cost_profile())))
    assert d.replica is not None
    return d.replica.name


def test_by_default_a_new_conversation_goes_where_the_prompt_is() -> None:
    spec = dict(DEFAULT_PROFILE)
    d = decide(
        DecisionInputs.of(
            RequestFeatures(path="/v1/chat/completions", model="m", session_key="new", prefix_hashes=tuple(range(40))),
            Snapshot((ReplicaState(Replica("r0", "h:0"), live_sessions=12), ReplicaState(Replica("r1", "h:1")))),
            AffinityView(prefix_matches={"r0": 32}),
            0.0,
            build_profile(spec),
        )
    )
    assert d.replica is not None and d.replica.name == "r0"  # the whole-cost rule is opt-in


def test_a_new_conversation_is_placed_by_the_conversations_a_replica_already_carries() -> None:
    assert new_conversation_goes_to(12) == "r1"  # 6 beyond its share
    assert new_conversation_goes_to(12, pinned="r0") == "r0"  # a pinned conversation stays
    assert new_conversation_goes_to(1) == "r0"  # within its share: it pays nothing


def test_a_system_prompt_every_conversation_shares_does_not_leave_replicas_idle() -> None:
    # In the simulator, before: 3 of 8 replicas took all 48 conversations (91.9% hit ratio).
    replica = get_profile("demo")
    cfg = Config(profile=whole_cost_profile())
    wl = shared_system_chat(48, 6, system_tokens=2000, document_tokens=300)
    sim = Simulation(wl, replica, 8, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg)
    run = sim.run()
    sessions: dict[int, set[str | None]] = {}
    for o in run.outcomes:
        sessions.setdefault(o.replica, set()).add(o.session)
    assert len(sessions) == 8 and all(len(s) >= 2 for s in sessions.values())
    prompt = sum(o.prompt_tokens for o in run.outcomes)
    assert sum(o.cached_tokens for o in run.outcomes) / prompt > 0.90
