"""Each replica's live working set (extproc/fleet/health/working_sets.py)."""

from __future__ import annotations

import copy

from extproc.fleet.health.working_sets import DEFAULT_GAP_S, GAP_FACTOR, WorkingSets
from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.registry import SCORES_PROFILE


def test_a_conversation_grows_where_it_stays_and_restarts_where_it_recomputes() -> None:
    w = WorkingSets()
    w.begin("a", "s", 0.0, 1000)
    w.end("s", 1.0)
    w.begin("a", "s", 1.5, 150)  # the turn's new part: its history is there
    assert w.tokens(1.6) == {"a": 1150}
    w.end("s", 2.0)
    w.begin("a", "s", 2.2, 1300)  # recomputed whole: its history had been lost
    assert w.tokens(2.3) == {"a": 1300}
    w.end("s", 2.5)
    w.begin("b", "s", 2.6, 1450)  # moved: nothing of it counts where it was
    assert w.tokens(2.7) == {"b": 1450}


def test_a_conversation_leaves_the_working_set_a_few_of_its_gaps_after_its_last_turn() -> None:
    w = WorkingSets()
    w.begin("a", "s", 0.0, 1000)
    w.end("s", 1.0)
    # No gap seen yet: the default.
    assert w.tokens(1.0 + GAP_FACTOR * DEFAULT_GAP_S - 1) == {"a": 1000}
    w.begin("a", "s", 3.0, 100)  # back after 2 s
    w.begin("a", "t", 3.0, 500)  # still running, whatever its age
    w.end("s", 4.0)
    assert w.tokens(4.0 + GAP_FACTOR * 2.0 - 0.5) == {"a": 1600}
    assert w.tokens(4.0 + GAP_FACTOR * 2.0 + 0.5) == {"a": 500}


def test_a_replica_that_left_holds_nothing() -> None:
    w = WorkingSets()
    w.begin("a", "s", 0.0, 1000)
    w.begin("b", "t", 0.0, 700)
    w.forget("a")
    assert w.tokens(0.1) == {"b": 700}


def test_at_most_max_sessions_are_kept_the_least_recent_dropped() -> None:
    w = WorkingSets(max_sessions=2)
    for i, session in enumerate(("s", "t", "u")):
        w.begin("a", session, float(i), 100)
    assert len(w) == 2 and w.tokens(3.0) == {"a": 200}


def scores_place_a_new_conversation(*replicas: ReplicaState, weight: float = 1.0) -> str:
    """Where the scores profile, its prefill cost weighing working sets at ``weight``, places a
    new conversation of 40 blocks (640 tokens) that no replica holds any of."""
    spec = copy.deepcopy(dict(SCORES_PROFILE))
    for scorer in spec["scorers"]:
        if scorer["type"] == "prefill_cost":
            scorer["parameters"] = {"working_set_weight": weight, "live_context_weight": 0.0}
    features = RequestFeatures(
        path="/v1/chat/completions", model="m", session_key="new", prefix_hashes=tuple(range(40)), prompt_chars=40 * 64
    )
    d = decide(DecisionInputs.of(features, Snapshot(replicas), AffinityView(), 0.0, build_profile(spec)))
    assert d.replica is not None
    return d.replica.name


def test_the_scores_profile_keeps_a_new_conversation_off_a_cache_it_would_overflow() -> None:
    # 4,096-token caches: "fits" would overflow with it (3,600 + 640), "over" overflows already.
    fits = ReplicaState(Replica("fits", "h:0"), kv_capacity_tokens=4096, working_set_tokens=3600)
    over = ReplicaState(Replica("over", "h:1"), kv_capacity_tokens=4096, working_set_tokens=9000)
    room = ReplicaState(Replica("room", "h:2"), kv_capacity_tokens=4096, working_set_tokens=1000)
    assert scores_place_a_new_conversation(fits, over, room) == "room"
    assert scores_place_a_new_conversation(fits, over) == "over"
