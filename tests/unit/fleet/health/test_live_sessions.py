"""A new conversation placed by its whole cost: the conversations each replica already carries."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter

from extproc.config import Config
from extproc.fleet.health.sessions import OPENING_WEIGHT, LiveSessions
from extproc.request.conversation import ConversationChain
from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.registry import SCORES_PROFILE
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import agents, shared_system_chat
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


def test_a_declared_conversation_counts_the_kv_of_its_own_where_it_lives_from_its_first_turn() -> None:
    live = LiveSessions(live_s=10.0)
    live.begin("r0", "a", 0.0, tokens=500)  # its task (the harness was cached there already)
    live.end("a")
    live.begin("r0", "b", 0.5, tokens=2000)  # the one that brought the harness
    live.end("b")
    assert live.tokens(1.0) == {"r0": 2500}  # a session key declares a conversation: counted at once
    live.begin("r0", "a", 1.0, tokens=300)  # a tool result
    live.end("a")
    assert live.tokens(1.5) == {"r0": 2800}
    live.begin("r1", "a", 4.0, tokens=900)  # moved: what it held on r0 is not carried to r1
    assert live.tokens(4.0) == {"r0": 2000, "r1": 900}
    live.end("a")
    assert live.tokens(10.8) == {"r1": 900}  # b's last turn began 10.3 s ago: b is no longer live
    assert live.tokens(20.0) == {} and live.counts(20.0) == {}
    live.forget("r1")
    assert live.tokens(20.0) == {}


def test_a_burst_of_declared_conversations_counts_each_as_it_is_placed() -> None:
    # What the real-vLLM module's burst needs: six new sessions sent one after another, none back
    # yet; each one placed is counted before the next is decided.
    live = LiveSessions()
    for i in range(6):
        live.begin(f"r{i % 2}", f"s{i}", 0.1 * i, tokens=300 + i)
        live.end(f"s{i}")
    assert live.tokens(1.0) == {"r0": 300 + 302 + 304, "r1": 301 + 303 + 305}


def test_a_keyless_opening_counts_at_the_rate_openings_come_back_and_in_full_once_it_does() -> None:
    live = LiveSessions(live_s=10.0)
    live.begin("r0", "k1", 0.0, tokens=1000, declared=False)
    live.begin("r0", "k2", 0.0, tokens=400, declared=False)
    live.end("k1")
    live.end("k2")
    # No opening has come back yet: it may be a one-off, counted at nothing.
    assert live.return_rate() == 0.0 and live.tokens(1.0) == {} and live.counts(1.0) == {"r0": 2}
    live.begin("r0", "k1", 2.0, tokens=100)  # k1 comes back: in full from now on
    live.end("k1")
    assert live.return_rate() == 1.0
    assert live.tokens(2.0) == {"r0": 1100 + 400}  # and k2, not back yet, at the rate (1)
    live.begin("r1", "k3", 3.0, tokens=600, declared=False)
    live.end("k3")
    assert live.tokens(3.0) == {"r0": 1500, "r1": 600}
    # k2 lapses at 10 s without coming back: one of two came back (the older a little less weight).
    assert live.tokens(10.5) == {"r0": 1100, "r1": round(600 * live.return_rate())}
    assert 0.49 < live.return_rate() < 0.51
    live.begin("r2", "k3", 11.0, tokens=50)  # k3 comes back on another replica: only what it adds there
    assert live.tokens(11.0) == {"r0": 1100, "r2": 50}
    # An agent asking to keep its KV across a tool call declares that it will come back.
    live.begin("r3", "k4", 11.0, tokens=70, hold_s=5.0, declared=False)
    assert live.tokens(11.0)["r3"] == 70


def test_a_keyless_opening_counts_at_least_a_quarter_while_its_first_turn_runs() -> None:
    # Eight keyless conversations opening together, before any has come back (the return rate
    # still 0): each placed sees the ones placed before it while their first turns run.
    assert OPENING_WEIGHT == 0.25
    live = LiveSessions(live_s=10.0)
    live.begin("r0", "k1", 0.0, tokens=2000, declared=False)
    assert live.return_rate() == 0.0 and live.tokens(0.0) == {"r0": 500}
    live.begin("r1", "k2", 0.0, tokens=40, declared=False)
    assert live.tokens(0.0) == {"r0": 500, "r1": 10}
    live.end("k1")  # its first turn is over, not back yet: at the rate (0)
    assert live.tokens(0.5) == {"r1": 10}
    live.begin("r0", "k1", 1.0, tokens=40)  # back: in full from now on
    assert live.tokens(1.0) == {"r0": 2040, "r1": 40}  # and k2 at the rate, 1 now
    live.end("k1")
    live.end("k2")
    assert live.tokens(1.5) == {"r0": 2040, "r1": 40}
    # A second turn sent before the first one ended: in full once, not twice, and after both end.
    live.begin("r2", "k3", 2.0, tokens=500, declared=False)
    live.begin("r2", "k3", 2.1, tokens=10)
    assert live.tokens(2.1)["r2"] == 510
    live.end("k3")
    live.end("k3")
    assert live.tokens(2.2)["r2"] == 510
    # An opening that moves replica while its first turn runs leaves nothing behind, nor does
    # one whose replica leaves.
    live.begin("r3", "k4", 3.0, tokens=300, declared=False)
    live.begin("r1", "k4", 3.1, tokens=20)
    assert "r3" not in live.tokens(3.1)
    live.begin("r3", "k5", 3.2, tokens=300, declared=False)
    live.forget("r3")
    live.end("k5")
    assert "r3" not in live.tokens(3.3)


def test_a_one_off_weighs_a_quarter_only_while_it_runs() -> None:
    # A hot prefix's single questions: each counts a quarter while it holds its KV, nothing after.
    live = LiveSessions(live_s=5.0)
    for i in range(100):
        live.begin("r0", f"q{i}", 0.1 * i, tokens=160, declared=False)
        assert live.tokens(0.1 * i) == {"r0": 40}
        live.end(f"q{i}")
        assert live.tokens(0.1 * i) == {}
    # Dropped while running (the bound), it leaves nothing counted either.
    bounded = LiveSessions(max_sessions=2)
    for i in range(3):
        bounded.begin("r0", f"q{i}", 0.0, tokens=100, declared=False)
    assert bounded.tokens(0.0) == {"r0": 50}


def test_one_offs_that_never_come_back_count_nothing() -> None:
    # A hot system prompt's single questions (each a keyless opening): counted, they spread the
    # prompt over replicas new to it (hot-prefix at rate x2 in the simulator: TTFT p99 0.053 ->
    # 0.165 s). They never come back, so the return rate stays 0.
    live = LiveSessions(live_s=5.0)
    for i in range(200):
        live.begin("r0", f"q{i}", 0.1 * i, tokens=150, declared=False)
        live.end(f"q{i}")
        assert live.tokens(0.1 * i) == {}
    assert live.return_rate() == 0.0 and live.counts(20.0) == {"r0": 50}
    # Once a tenth of the openings come back, about that share of what the others added counts (a
    # return is known at once, a lapse only a window later: the rate leans high, here 0.29).
    for i in range(200, 400):
        live.begin("r0", f"q{i}", 0.1 * i, tokens=150, declared=False)
        live.end(f"q{i}")
        if i % 10 == 0:
            live.begin("r0", f"q{i}", 0.1 * i + 0.05, tokens=0)
            live.end(f"q{i}")
    assert 0.05 < live.return_rate() < 0.35
    provisional = 150 * sum(1 for i in range(350, 400) if i % 10)
    firm = 150 * sum(1 for i in range(350, 400) if i % 10 == 0)
    assert live.tokens(40.0)["r0"] == firm + round(provisional * live.return_rate())


def test_the_conversations_expected_back_weigh_keyless_openings_as_their_kv_is_weighed() -> None:
    live = LiveSessions(live_s=10.0)
    live.begin("r0", "d", 0.0, tokens=100)  # declared: expected back
    for i in range(4):  # a hot prefix's single questions, running: a quarter each
        live.begin("r1", f"q{i}", 0.0, tokens=100, declared=False)
    assert live.expected(0.0) == {"r0": 1.0, "r1": 1.0}
    for i in range(4):
        live.end(f"q{i}")  # over, none back yet: nothing to come
    assert live.expected(0.5) == {"r0": 1.0, "r1": 0.0}
    live.begin("r1", "q0", 1.0)  # one came back: in full, and the others at the return rate
    assert live.expected(1.0)["r1"] == 1.0 + 3 * live.return_rate()


def test_the_conversations_expected_back_agree_with_a_count_over_the_sessions() -> None:
    # Random turns (declared or keyless, moving between replicas, ending, expiring, replicas
    # leaving): the running per-replica figures equal a plain sum over the live sessions.
    rng = random.Random(5)
    live = LiveSessions(live_s=3.0, max_sessions=40)
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.05
        session = f"s{rng.randrange(60)}"
        roll = rng.random()
        if roll < 0.55:
            live.begin(f"r{rng.randrange(3)}", session, now, tokens=rng.randrange(200), declared=rng.random() < 0.4)
        elif roll < 0.95:
            live.end(session)
        else:
            live.forget(f"r{rng.randrange(3)}")
        got = live.expected(now)
        rate = live.return_rate()
        want: dict[str, float] = {}
        for s in live._sessions.values():
            weight = 1.0 if s.firm else (max(rate, live.opening_weight) if s.inflight else rate)
            want[s.replica] = want.get(s.replica, 0.0) + weight
        assert set(got) == set(want)
        assert all(abs(got[r] - want[r]) < 1e-9 for r in want)


def test_live_sessions_are_bounded() -> None:
    live = LiveSessions(live_s=1e9, max_sessions=100)
    for i in range(1000):
        live.begin(f"r{i % 4}", f"s{i}", float(i))
        live.end(f"s{i}")
    assert len(live) == 100 and sum(live.counts(1000.0).values()) == 100


def whole_cost_profile() -> dict[str, object]:
    """The scores profile with a new conversation placed by its whole cost (``session_tokens``)."""
    spec = copy.deepcopy(dict(SCORES_PROFILE))
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


def test_in_the_scores_profile_the_count_of_conversations_alone_moves_nothing() -> None:
    spec = dict(SCORES_PROFILE)
    d = decide(
        DecisionInputs.of(
            RequestFeatures(path="/v1/chat/completions", model="m", session_key="new", prefix_hashes=tuple(range(40))),
            Snapshot((ReplicaState(Replica("r0", "h:0"), live_sessions=12), ReplicaState(Replica("r1", "h:1")))),
            AffinityView(prefix_matches={"r0": 32}),
            0.0,
            build_profile(spec),
        )
    )
    # ``session_tokens`` is opt-in there; the conversations' own KV (none here) is what it counts
    assert d.replica is not None and d.replica.name == "r0"


def new_conversation_by_scores(
    r0_own: int, matched: int = 32, pinned: str | None = None, chain: ConversationChain | None = None
) -> str:
    """Where a new conversation of 40 blocks (640 tokens) goes with the scores profile when r0
    holds ``matched`` of its blocks and its live conversations hold ``r0_own`` tokens of KV of
    their own, r1 neither (``chain``: a keyless request's, by which its session key was found)."""
    features = RequestFeatures(
        path="/v1/chat/completions",
        model="m",
        session_key="new",
        prefix_hashes=tuple(range(40)),
        prompt_chars=40 * 64,
        conversation=chain,
    )
    replicas = (
        ReplicaState(Replica("r0", "h:0"), live_sessions=4, live_session_tokens=r0_own),
        ReplicaState(Replica("r1", "h:1")),
    )
    view = AffinityView(pinned=pinned, prefix_matches={"r0": matched})
    d = decide(DecisionInputs.of(features, Snapshot(replicas), view, 0.0, build_profile(dict(SCORES_PROFILE))))
    assert d.replica is not None
    return d.replica.name


def test_a_shared_prefix_draws_a_new_conversation_only_until_the_conversations_there_outweigh_it() -> None:
    # r0 holds the system prompt (32 blocks: 512 tokens of prefill saved, once).
    assert new_conversation_by_scores(0) == "r0"
    assert new_conversation_by_scores(400) == "r0"  # 200 beyond the mean of 200: less than the saving
    assert new_conversation_by_scores(8000) == "r1"  # 4,000 beyond its share: prefill the prompt on r1
    assert new_conversation_by_scores(8000, pinned="r0") == "r0"  # a continuing conversation stays
    # A fork: its prompt is its parent's whole context, held on r0; it goes with its parent until
    # r0 carries more than that context beyond its share.
    assert new_conversation_by_scores(8000, matched=40) == "r1"
    assert new_conversation_by_scores(1000, matched=40) == "r0"


def test_in_the_scores_profile_a_keyless_history_the_router_does_not_remember_is_not_a_new_conversation() -> None:
    # Its messages continue a conversation no request the router saw ended with ("unmatched"): it
    # lives where its blocks are, as a pinned one does, and is not placed by r0's conversations.
    unmatched = ConversationChain(end=1, turn=2, messages=3, conversation=7, match="unmatched")
    assert new_conversation_by_scores(8000, matched=36, chain=unmatched) == "r0"
    opened = ConversationChain(end=1, turn=None, messages=1, conversation=7, match="new")
    assert new_conversation_by_scores(8000, matched=36, chain=opened) == "r1"


def test_a_burst_of_new_conversations_with_one_prompt_is_not_split_by_its_own_kv() -> None:
    # The first brought the prompt (its own KV there); the next ones add nothing of their own.
    live = LiveSessions()
    live.begin("r0", "s1", 0.0, tokens=640)
    for i in range(2, 6):
        live.begin("r0", f"s{i}", 0.1 * i, tokens=0)
    own = live.tokens(1.0)["r0"]
    assert own == 640 and new_conversation_by_scores(own, matched=40) == "r0"
    for i in range(1, 6):  # their second turns
        live.begin("r0", f"s{i}", 1.0 + 0.1 * i, tokens=20)
    own = live.tokens(2.0)["r0"]
    assert own == 740 and new_conversation_by_scores(own, matched=40) == "r0"


def test_a_new_conversation_is_placed_by_the_conversations_a_replica_already_carries() -> None:
    assert new_conversation_goes_to(12) == "r1"  # 6 beyond its share
    assert new_conversation_goes_to(12, pinned="r0") == "r0"  # a pinned conversation stays
    assert new_conversation_goes_to(1) == "r0"  # within its share: it pays nothing


def test_with_the_default_profile_a_shared_system_prompt_does_not_herd() -> None:
    # Before the conversations' own KV was counted: 3 of 8 replicas took all 48 conversations.
    replica = get_profile("demo")
    cfg = Config()
    wl = shared_system_chat(48, 6, system_tokens=2000, document_tokens=300)
    sim = Simulation(wl, replica, 8, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg)
    run = sim.run()
    sessions: dict[int, set[str | None]] = {}
    for o in run.outcomes:
        sessions.setdefault(o.replica, set()).add(o.session)
    assert len(sessions) >= 6, {k: len(v) for k, v in sessions.items()}
    assert max(len(s) for s in sessions.values()) <= 12, {k: len(v) for k, v in sessions.items()}
    prompt = sum(o.prompt_tokens for o in run.outcomes)
    assert sum(o.cached_tokens for o in run.outcomes) / prompt > 0.88


def test_with_the_default_profile_keyless_conversations_opening_together_do_not_herd() -> None:
    # benchmarks/keyless_conversations.py's workload in the simulator: 8 keyless conversations at
    # a time sharing a long system prompt, short questions. When an opening counted only at the
    # return rate (0 before any had come back), the first eight followed the prompt's holder:
    # 6, 84, 6, 96 requests on the four replicas (2.00x the mean), as through real Envoy. At a
    # tenth while their first turns run, 1.75-1.88x; from a quarter, 48 each.
    replica = get_profile("demo")
    cfg = Config()
    short = {"document_tokens": 20, "followup_tokens": 10, "max_tokens": 8}
    wl = shared_system_chat(32, 6, live=8, stagger_s=0.0, system_tokens=2000, keyed=False, **short)
    sim = Simulation(wl, replica, 4, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg)
    per_replica = Counter(o.replica for o in sim.run().outcomes)
    assert len(per_replica) == 4 and max(per_replica.values()) <= 1.5 * 192 / 4, per_replica


def test_with_the_default_profile_agents_sharing_a_harness_do_not_herd() -> None:
    # Before the conversations' own KV was counted: all 16 agents on one replica.
    replica = dataclasses.replace(get_profile("llama-8b-h100"), num_gpu_blocks=3000)
    cfg = Config()
    wl = agents(16, rate=4.0)
    sim = Simulation(wl, replica, 4, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg)
    used = {o.replica for o in sim.run().outcomes}
    assert len(used) >= 3, used


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
