"""The pure decision: stickiness, prefix affinity, spillover, failover, hashing."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.features import RequestFeatures
from extproc.routing import (
    SCORES_PROFILE,
    AffinityView,
    DecisionInputs,
    HashRing,
    Profile,
    Reason,
    Replica,
    ReplicaState,
    Snapshot,
    build_profile,
    decide,
)

CHAT = "/v1/chat/completions"


def scores_profile() -> Profile:
    # The scores profile's rules (stickiness by its floor, spillover at the overload filter), named
    # so that they hold whatever the default profile is; the price has its own (test_price.py).
    return build_profile(SCORES_PROFILE)


def snapshot(n: int = 4, **overrides: dict[str, object]) -> Snapshot:
    states = []
    for i in range(n):
        name = f"r{i}"
        states.append(ReplicaState(Replica(name, f"127.0.0.1:{9000 + i}"), **overrides.get(name, {})))  # type: ignore[arg-type]
    return Snapshot(tuple(states))


def features(session: str | None = None, hashes: tuple[int, ...] = (), request_id: str = "") -> RequestFeatures:
    return RequestFeatures(path=CHAT, model="m", session_key=session, prefix_hashes=hashes, request_id=request_id)


def test_pinned_session_is_sticky() -> None:
    d = decide(DecisionInputs.of(features("s1"), snapshot(), AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r2" and d.reason is Reason.STICKY


def test_pin_outweighs_a_full_prefix_match_elsewhere() -> None:
    view = AffinityView(pinned="r2", prefix_matches={"r1": 10, "r2": 10})
    d = decide(
        DecisionInputs.of(
            features("s1", tuple(range(10))),
            snapshot(r1={"inflight": 0}, r2={"inflight": 5}),
            view,
            0.0,
            scores_profile(),
        )
    )
    assert d.replica is not None and d.replica.name == "r2"


def test_a_pin_the_index_forgot_still_holds_the_session() -> None:
    # The index no longer claims the conversation on r2, but nothing the replica said confirms a
    # loss (no eviction event, no misses on its counters): the session stays where it is.
    view = AffinityView(pinned="r2", prefix_matches={"r1": 2, "r2": 2, "r3": 2, "r0": 2})
    snap = snapshot(r2={"inflight": 8, "pending_prefill_tokens": 20_000})
    d = decide(DecisionInputs.of(features("s1", tuple(range(40))), snap, view, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r2" and d.reason is Reason.STICKY and d.moved_by == ""


def test_a_pin_whose_cache_is_known_lost_moves_only_for_a_better_place() -> None:
    snap = snapshot(r2={"inflight": 8, "pending_prefill_tokens": 20_000})
    lost = AffinityView(pinned="r2", prefix_matches={"r1": 2, "r2": 2, "r3": 2, "r0": 2}, pin_lost="kv_events")
    # Evicted and loaded: another replica is worth the move, and the decision says what moved it.
    d = decide(DecisionInputs.of(features("s1", tuple(range(40))), snap, lost, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2"
    assert d.reason is Reason.EVICTED and d.moved_by == "kv_events"
    # Evicted but no busier than the rest, and nobody holds more of this conversation: moving would
    # only rebuild it elsewhere, so it stays.
    d = decide(DecisionInputs.of(features("s1", tuple(range(40))), snapshot(), lost, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r2" and d.reason is Reason.STICKY
    # Another replica holds most of this conversation: that outweighs the price of moving.
    elsewhere = AffinityView(pinned="r2", prefix_matches={"r1": 36, "r2": 2, "r3": 2}, pin_lost="hit_counters")
    d = decide(DecisionInputs.of(features("s1", tuple(range(40))), snapshot(), elsewhere, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r1" and d.moved_by == "hit_counters"
    # Still held there: it stays, however the evidence was labelled.
    held = AffinityView(pinned="r2", prefix_matches={"r1": 2, "r2": 40, "r3": 2, "r0": 2}, pin_lost="kv_events")
    d = decide(DecisionInputs.of(features("s1", tuple(range(40))), snap, held, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r2" and d.reason is Reason.STICKY


def test_overloaded_pinned_replica_spills_over() -> None:
    snap = snapshot(r2={"kv_usage": 0.95, "queue": 20})
    d = decide(DecisionInputs.of(features("s1"), snap, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2" and d.reason is Reason.SPILLOVER
    assert d.moved_by == "overload"


def test_a_spilled_turn_keeps_its_pin_only_where_the_pin_holds_the_conversation() -> None:
    # A pinned session's spill leaves the pin where its conversation is: it returns there.
    snap = snapshot(r2={"kv_usage": 0.95, "queue": 20})
    d = decide(DecisionInputs.of(features("s1"), snap, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.reason is Reason.SPILLOVER and not d.pin
    # A new session whose prefix's holder is full spills too, but it has nowhere to return to: it is
    # pinned where it went, where its history now is (unpinned, its every later turn was placed by
    # the index alone and spilled again).
    view = AffinityView(prefix_matches={"r2": 4})  # under half of the prompt: no holder, judged on its KV and queue
    d = decide(DecisionInputs.of(features("s1", tuple(range(10))), snap, view, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2" and d.reason is Reason.SPILLOVER and d.pin
    # Nor where its pin lost the conversation (its own events say so): there is nothing to return to.
    lost = AffinityView(pinned="r2", pin_lost="kv_events")
    d = decide(DecisionInputs.of(features("s1"), snap, lost, 0.0, scores_profile()))
    assert d.reason is Reason.SPILLOVER and d.pin and d.moved_by == "overload"


def test_pinned_replica_out_of_rotation_fails_over() -> None:
    snap = snapshot(r2={"in_rotation": False})
    d = decide(DecisionInputs.of(features("s1"), snap, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2" and d.reason is Reason.FAILOVER
    assert d.moved_by == "in_rotation"


def test_all_out_of_rotation_still_routes() -> None:
    snap = snapshot(**{f"r{i}": {"in_rotation": False} for i in range(4)})
    d = decide(DecisionInputs.of(features("s1"), snap, AffinityView(), 0.0, scores_profile()))
    assert d.replica is not None


def test_no_replicas_is_no_replica() -> None:
    d = decide(DecisionInputs.of(features("s1"), Snapshot(()), AffinityView(), 0.0, scores_profile()))
    assert d.replica is None and d.reason is Reason.NO_REPLICA


def test_strong_prefix_match_wins_for_new_requests() -> None:
    view = AffinityView(prefix_matches={"r3": 9})
    d = decide(DecisionInputs.of(features(None, tuple(range(10))), snapshot(), view, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r3" and d.reason is Reason.PREFIX
    assert d.matched_blocks == 9 and d.total_blocks == 10


def test_weak_shared_prefix_does_not_herd() -> None:
    # Every request shares its first block (a common system prompt) with r0: a 1-of-40 match
    # must not send every new session there.
    view = AffinityView(prefix_matches={"r0": 1})
    chosen = Counter()
    for i in range(200):
        d = decide(DecisionInputs.of(features(f"s{i}", tuple(range(40))), snapshot(), view, 0.0, scores_profile()))
        assert d.replica is not None
        chosen[d.replica.name] += 1
    assert chosen["r0"] < 100 and len(chosen) == 4


def test_new_sessions_spread_by_hashing() -> None:
    chosen = Counter()
    for i in range(400):
        d = decide(DecisionInputs.of(features(f"session-{i}"), snapshot(), AffinityView(), 0.0, scores_profile()))
        assert d.replica is not None and d.reason is Reason.NEW_SESSION
        chosen[d.replica.name] += 1
    assert len(chosen) == 4 and min(chosen.values()) > 50


def test_requests_without_any_key_spread_over_request_ids() -> None:
    chosen = Counter()
    for i in range(200):
        d = decide(
            DecisionInputs.of(features(request_id=f"req-{i}"), snapshot(), AffinityView(), 0.0, scores_profile())
        )
        assert d.replica is not None and d.reason is Reason.FALLBACK
        chosen[d.replica.name] += 1
    assert len(chosen) == 4


def test_bounded_load_passes_over_a_busy_ring_owner() -> None:
    profile = scores_profile()
    idle = decide(DecisionInputs.of(features("k"), snapshot(), AffinityView(), 0.0, profile))
    assert idle.replica is not None
    busy = snapshot(**{idle.replica.name: {"inflight": 10}})
    d = decide(DecisionInputs.of(features("k"), busy, AffinityView(), 0.0, profile))
    assert d.replica is not None and d.replica.name != idle.replica.name


def test_fallbacks_are_other_replicas() -> None:
    d = decide(DecisionInputs.of(features("s"), snapshot(), AffinityView(), 0.0, scores_profile()))
    assert d.replica is not None
    assert d.replica not in d.fallbacks and len(d.fallbacks) == 2


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.integers(0, 50), st.floats(0, 1)), min_size=1, max_size=8),
    st.one_of(st.none(), st.text(max_size=8)),
    st.dictionaries(st.integers(0, 7), st.integers(0, 20)),
    st.one_of(st.none(), st.integers(0, 7)),
)
def test_decision_is_always_a_member_with_scores_in_range(
    states: list[tuple[bool, int, int, float]], session: str | None, matches: dict[int, int], pinned: int | None
) -> None:
    snap = Snapshot(
        tuple(
            ReplicaState(Replica(f"r{i}", f"h:{i + 1}"), in_rotation=rot, inflight=inf, queue=q, kv_usage=kv)
            for i, (rot, inf, q, kv) in enumerate(states)
        )
    )
    view = AffinityView(
        pinned=f"r{pinned}" if pinned is not None else None,
        prefix_matches={f"r{k}": v for k, v in matches.items()},
    )
    profile = scores_profile()
    d = decide(DecisionInputs.of(features(session, tuple(range(20))), snap, view, 0.0, profile))
    assert d.replica is not None and snap.get(d.replica.name) is not None
    total_weight = sum(w.weight for w in profile.scorers)
    assert all(0.0 <= s <= total_weight + 1e-9 for s in d.scores.values())
    again = decide(DecisionInputs.of(features(session, tuple(range(20))), snap, view, 0.0, profile))
    assert again.replica == d.replica  # deterministic: no hidden clock or randomness


def test_ring_moves_about_one_nth_of_keys_when_a_replica_joins() -> None:
    before = HashRing([(f"r{i}", 1.0) for i in range(8)])
    after = HashRing([(f"r{i}", 1.0) for i in range(9)])
    keys = [f"key-{i}" for i in range(5000)]
    moved = sum(before.preference(k, 1) != after.preference(k, 1) for k in keys)
    assert 0.05 < moved / len(keys) < 0.18  # ideal 1/9 = 0.111
    # and every moved key moved to the newcomer
    assert all(after.preference(k, 1) == ["r8"] for k in keys if before.preference(k, 1) != after.preference(k, 1))


@given(st.integers())
def test_any_integer_key_has_a_place_on_the_ring(key: int) -> None:
    ring = HashRing([(f"r{i}", 1.0) for i in range(4)])
    assert len(ring.preference(key, 2)) == 2  # negative (Python's hash) or wider than 64 bits too


def test_ring_weight_is_proportional() -> None:
    ring = HashRing([("small", 1.0), ("big", 3.0)])
    owners = Counter(ring.preference(f"k{i}", 1)[0] for i in range(4000))
    assert 2.3 < owners["big"] / owners["small"] < 3.9


replica_loads = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 32), st.floats(0, 0.9), st.integers(0, 30)), min_size=2, max_size=10
)


@settings(max_examples=150)
@given(replica_loads, st.integers(0, 9), st.dictionaries(st.integers(0, 9), st.integers(1, 40)), st.text(min_size=1))
def test_a_session_keeps_its_replica_while_it_is_healthy_not_overloaded_and_its_cache_held(
    loads: list[tuple[int, int, float, int]], pinned: int, matches: dict[int, int], session: str
) -> None:
    pinned %= len(loads)
    snap = Snapshot(
        tuple(
            ReplicaState(Replica(f"r{i}", f"h:{i + 1}"), inflight=inf, queue=q, kv_usage=kv, recent_requests=rec)
            for i, (inf, q, kv, rec) in enumerate(loads)
        )
    )
    held = {f"r{k % len(loads)}": v for k, v in matches.items()}
    held[f"r{pinned}"] = 40  # its conversation is still believed cached there
    view = AffinityView(pinned=f"r{pinned}", prefix_matches=held)
    d = decide(DecisionInputs.of(features(session, tuple(range(40))), snap, view, 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == f"r{pinned}" and d.reason is Reason.STICKY


@settings(max_examples=150)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=12), st.text(min_size=1), st.floats(1.0, 2.0))
def test_the_ring_never_gives_a_replica_more_than_the_bound(inflight: list[int], key: str, load_factor: float) -> None:
    from extproc.routing.plugins import CycleState
    from extproc.routing.scorers import RingScorer

    snap = Snapshot(tuple(ReplicaState(Replica(f"r{i}", f"h:{i + 1}"), inflight=n) for i, n in enumerate(inflight)))
    profile = scores_profile()
    cycle = CycleState(features(key), snap, AffinityView(), 0.0, profile.ring_for(snap), key, "session")
    scores = RingScorer(load_factor=load_factor).score(cycle, list(snap.replicas))
    (owner,) = [name for name, s in scores.items() if s == 1.0]
    bound = math.ceil(load_factor * (sum(inflight) + 1) / len(inflight))
    fits = [s for s in snap.replicas if s.inflight + 1 <= bound]
    state = snap.get(owner)
    assert state is not None
    assert state.inflight + 1 <= bound or not fits


@settings(max_examples=40)
@given(st.integers(3, 16), st.integers(0, 10_000))
def test_a_join_moves_at_most_about_its_share_of_bounded_placements(n: int, seed: int) -> None:
    from extproc.routing.plugins import CycleState
    from extproc.routing.scorers import RingScorer

    def owners(count: int) -> list[str]:
        snap = Snapshot(tuple(ReplicaState(Replica(f"r{i}", f"h:{i + 1}")) for i in range(count)))
        ring = scores_profile().ring_for(snap)
        out = []
        for k in range(1500):
            key = f"{seed}-{k}"
            cycle = CycleState(features(key), snap, AffinityView(), 0.0, ring, key, "session")
            scores = RingScorer().score(cycle, list(snap.replicas))
            out.append(next(name for name, s in scores.items() if s == 1.0))
        return out

    before, after = owners(n), owners(n + 1)
    moved = sum(a != b for a, b in zip(before, after, strict=True))
    assert moved / len(before) <= 1 / (n + 1) + 0.06  # about 1/(N+1), with slack for vnode variance
    assert all(b == f"r{n}" for a, b in zip(before, after, strict=True) if a != b)


def test_a_turn_only_its_pinned_engine_stores_stays_there_when_that_replica_is_overloaded() -> None:
    from dataclasses import replace

    from extproc.request.conversation import response_chain

    snap = snapshot(r2={"kv_usage": 0.95, "queue": 40})
    chain = replace(response_chain("resp_1", "resp_2", "", 0, 2), conversation=7, match="continued")
    stored = replace(features("conv-0000000000000007"), conversation=chain)
    d = decide(DecisionInputs.of(stored, snap, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name == "r2"  # elsewhere the engine answers 404
    # A chat conversation (its history resent) spills over as any session does.
    d = decide(DecisionInputs.of(features("s1"), snap, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2"
    # Its engine out of rotation: it fails over (the next turn may well be a 404, the engine's word).
    gone = snapshot(r2={"in_rotation": False})
    d = decide(DecisionInputs.of(stored, gone, AffinityView(pinned="r2"), 0.0, scores_profile()))
    assert d.replica is not None and d.replica.name != "r2"
