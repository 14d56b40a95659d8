"""The peer routers, as simulation policies, behave as their projects publish; their state lives
in the run's policy objects, never in the router's registry or pipeline."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

from extproc.api import (
    REGISTRY,
    AffinityView,
    Config,
    DecisionInputs,
    ProfileError,
    Reason,
    Replica,
    ReplicaState,
    RequestFeatures,
    Snapshot,
    build_profile,
)
from extproc_lab.bench.policies import PEER_DEFS, PEERS, policy_profile
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.peers import (
    ApproximateTree,
    ConsistentHash,
    DynamoCost,
    Fleet,
    KVCacheUtilizationScorer,
    LeastRequest,
    MatchFractionScorer,
    PeerDecision,
    PeerPolicy,
    PowerOfTwo,
    QueueScorer,
    RandomChoice,
    RoundRobin,
    SGLangCacheAware,
    gie_default,
)
from extproc_lab.replica import PROFILES
from extproc_lab.sim.figures import figures
from extproc_lab.sim.simulator import Simulation

NAMES = ("a", "b", "c", "d")


def states(**fields: Mapping[str, float]) -> tuple[ReplicaState, ...]:
    """Replica states with per-replica values, e.g. ``inflight={"a": 3}``."""
    out: list[ReplicaState] = []
    for n in NAMES:
        values = {k: v[n] for k, v in fields.items() if n in v}
        out.append(ReplicaState(Replica(n, f"10.0.0.1:{8000 + len(out)}"), **values))  # type: ignore[arg-type]
    return tuple(out)


def features(session: str | None = None, blocks: int = 10, request_id: str = "r1") -> RequestFeatures:
    return RequestFeatures(
        path="/v1/chat/completions",
        model="m",
        session_key=session,
        prompt_chars=blocks * 64,
        prefix_hashes=tuple(range(1, blocks + 1)),
        request_id=request_id,
    )


def route(peer: PeerPolicy, snap: tuple[ReplicaState, ...], f: RequestFeatures) -> str:
    """What the simulator does for one request: the peer chooses, then learns where it went."""
    chosen = peer.choose(f, Fleet(snap))[0].name
    peer.observe(f, chosen)
    return chosen


def test_round_robin_cycles_through_replicas_in_order() -> None:
    peer = RoundRobin()
    assert [route(peer, states(), features()) for _ in range(8)] == list("abcdabcd")
    # Choosing alone moves nothing: the turn passes when a request is sent.
    assert [peer.choose(features(), Fleet(states()))[0].name for _ in range(3)] == ["a", "a", "a"]


@pytest.mark.parametrize("kind", [RandomChoice, LeastRequest, PowerOfTwo])
def test_randomised_peers_are_seeded_not_clock_driven(kind: type[RandomChoice | LeastRequest | PowerOfTwo]) -> None:
    def run(seed: int) -> list[str]:
        peer = kind(seed=seed)
        return [route(peer, states(), features()) for _ in range(20)]

    assert run(3) == run(3)
    assert len(set(run(3))) > 1  # ties and draws spread over replicas
    assert route(kind(rng=random.Random(5)), states(), features()) in NAMES


def test_least_request_and_power_of_two_avoid_the_busy() -> None:
    busy = states(inflight={"a": 9, "b": 9, "c": 0, "d": 9}, running={"a": 9, "b": 9, "c": 0, "d": 9})
    assert all(route(LeastRequest(seed=s), busy, features()) == "c" for s in range(10))
    # Power of two never picks the busier of its two draws (the draws recorded as they are made).
    loads = {"a": 9, "b": 5, "c": 0, "d": 7}
    spread = states(inflight=loads, running=loads)
    for seed in range(60):
        rng = RecordingRandom(seed)
        chosen = route(PowerOfTwo(rng=rng), spread, features())
        (pair,) = rng.draws
        assert chosen == min(pair, key=loads.__getitem__), (pair, chosen)


class RecordingRandom(random.Random):
    """A seeded generator that remembers what ``sample`` drew."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.draws: list[list[str]] = []

    def sample(self, population: Sequence[Any], k: int, *, counts: Iterable[int] | None = None) -> list[Any]:
        out = super().sample(population, k, counts=counts)
        self.draws.append([c.name for c in out])
        return out


def test_consistent_hash_is_sticky_without_a_load_bound() -> None:
    peer = ConsistentHash()
    overloaded = states(inflight={"a": 500, "b": 500, "c": 500, "d": 500})
    first = route(peer, states(), features("s-1"))
    assert all(route(peer, overloaded, features("s-1", request_id=f"x{i}")) == first for i in range(5))
    spread = Counter(route(peer, states(), features(f"s-{i}")) for i in range(200))
    assert len(spread) == 4 and min(spread.values()) > 20
    # Without a session key the request id is the key: requests spread.
    assert len({route(peer, states(), features(None, request_id=f"q{i}")) for i in range(50)}) > 1


def test_sglang_cache_aware_thresholds() -> None:
    peer = SGLangCacheAware()
    snap = states()
    doc = features(blocks=20)
    first = peer.choose(doc, Fleet(snap))[0].name
    assert peer.tree.size(first) == 0  # the tree learns when the request is sent, not when chosen
    peer.observe(doc, first)
    # Smallest tree for a prompt it has never seen; then the holder of a prefix matching > 30%.
    assert peer.tree.size(first) == 20
    again = features(blocks=20, request_id="r2")
    assert route(peer, snap, again) == first
    short_match = RequestFeatures(
        path="/v1/chat/completions", prompt_chars=100 * 64, prefix_hashes=(1, 2, 3, *range(500, 597)), request_id="r3"
    )
    assert peer.choose(short_match, Fleet(snap))[0].name != first  # 3% match: smallest tree
    # A spread of 50 in flight is under the absolute threshold (64): the cache still decides.
    mild = states(inflight={n: 10 if n != first else 60 for n in NAMES})
    assert peer.choose(again, Fleet(mild))[0].name == first
    # Imbalance over both thresholds: the least loaded, whatever the cache says.
    skewed = states(inflight={n: 10 if n == "c" else 100 for n in NAMES})
    assert peer.choose(again, Fleet(skewed))[0].name == "c"


def test_approximate_tree_counts_leading_blocks_per_replica_and_evicts() -> None:
    tree = ApproximateTree(blocks_per_replica=5)
    tree.insert("a", [1, 2, 3])
    tree.insert("b", [1, 2, 9])
    assert tree.matches([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    tree.insert("a", [7, 8, 6])
    # Over capacity, the least recently sent block goes first, and of one prompt its tail.
    assert tree.size("a") == 5 and tree.matches([1, 2, 3], ["a"]) == {"a": 2}


def test_gie_scorers_and_default_profile() -> None:
    snap = states(queue={"a": 0, "b": 4, "c": 8, "d": 8}, kv_usage={"a": 0.9, "b": 0.1, "c": 0.5, "d": 0.0})
    f = features(blocks=300)
    # The router's view (its estimate's matches) is not what GIE scores: GIE keeps its own index.
    fleet = Fleet(snap, {"a": 300})
    assert QueueScorer().score(f, fleet) == {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.0}
    assert KVCacheUtilizationScorer().score(f, fleet)["a"] == pytest.approx(0.1)
    prefix = MatchFractionScorer()
    assert prefix.score(f, fleet) == dict.fromkeys(NAMES, 0.0)
    prefix.observe(features(blocks=128), "c")
    prefix.observe(f, "d")
    assert prefix.score(f, fleet) == {"a": 0.0, "b": 0.0, "c": 0.5, "d": 1.0}  # both capped at 256 blocks
    small = MatchFractionScorer(capacity_per_server=100)  # GIE's LRU per server
    small.observe(f, "d")
    assert small.score(f, fleet)["d"] == 100 / 256  # a prompt's tail goes first
    assert QueueScorer().score(f, Fleet(states())) == dict.fromkeys(NAMES, 1.0)
    gie = gie_default(seed=1)
    for name, request in (("c", features(blocks=128)), ("d", f)):
        gie.observe(request, name)
    assert gie.totals(f, fleet)["a"] == pytest.approx(2 + 2 * 0.1 + 0)
    assert gie.choose(f, fleet)[0].name == "d"  # 0 + 2 + 3 beats a's 2 + 0.2 + 0
    # Equal totals: drawn at random (seeded), not always the first by name.
    assert len({gie_default(seed=s).choose(f, Fleet(states()))[0].name for s in range(20)}) > 1


class FixedProbe:
    def __init__(self, cached: Mapping[str, int], active: Mapping[str, int]) -> None:
        self.cached, self.active = cached, active

    def cached_tokens(self, features: RequestFeatures) -> Mapping[str, int]:
        return self.cached

    def active_blocks(self) -> Mapping[str, int]:
        return self.active


def test_dynamo_cost_trades_prefill_saved_against_decode_load() -> None:
    f = features(blocks=400)  # 6,400 tokens: 400 blocks of 16
    fleet = Fleet(states())
    probe = FixedProbe({"a": 6400}, {"a": 300, "b": 0, "c": 0, "d": 0})
    peer = DynamoCost(probe=probe)
    costs = peer.costs(f, fleet)
    assert costs["a"] == pytest.approx(0 + 300 + 400)
    assert costs["b"] == pytest.approx(400 + 0 + 400)
    assert peer.choose(f, fleet)[0].name == "a"
    busy = FixedProbe({"a": 6400}, {"a": 900, "b": 0, "c": 0, "d": 0})
    assert DynamoCost(probe=busy).choose(f, fleet)[0].name == "b"
    # Without KV events: the store's approximate index and the scraped KV usage.
    approx = DynamoCost(num_gpu_blocks=1000)
    kv = Fleet(states(kv_usage={"a": 0.0, "b": 0.0, "c": 0.2, "d": 0.0}), {"c": 400})
    assert approx.choose(f, kv)[0].name == "c"


def test_a_peer_decision_states_what_ours_would() -> None:
    decide = PeerDecision(RoundRobin())
    profile = build_profile({"filters": [], "scorers": [], "picker": {"type": "max_score"}})
    snap = Snapshot(states())
    pinned = AffinityView(pinned="a", prefix_matches={"a": 4})
    d = decide(DecisionInputs.of(features("s-1"), snap, pinned, 0.0, profile))
    assert d.replica is not None and d.replica.name == "a" and d.reason is Reason.STICKY and d.pin
    assert d.matched_blocks == 4 and [r.name for r in d.fallbacks] == ["b", "c"]
    decide.peer.observe(features("s-1"), "a")
    d = decide(DecisionInputs.of(features("s-1"), snap, pinned, 0.0, profile))
    assert d.replica is not None and d.replica.name == "b" and d.reason is Reason.FAILOVER
    assert decide(DecisionInputs.of(features(), snap, AffinityView(), 0.0, profile)).reason is Reason.NEW_SESSION
    assert decide(DecisionInputs.of(features(), Snapshot(()), AffinityView(), 0.0, profile)).reason is Reason.NO_REPLICA


def test_the_routers_registry_names_no_peer() -> None:
    ours = set(REGISTRY.filters) | set(REGISTRY.scorers) | set(REGISTRY.pickers)
    assert not ours & {*PEERS, "gie_max_score", "gie_queue", "llmd_precise_prefix", "oracle"}
    with pytest.raises(ProfileError, match="round_robin"):
        build_profile({"filters": [], "scorers": [], "picker": {"type": "round_robin"}})
    assert "oracle" not in PEER_DEFS


def test_a_peers_state_belongs_to_its_run() -> None:
    cfg, llama = Config(), PROFILES["llama-8b-h100"]
    wl = WorkloadSpec("multi-turn", rate=1.0, seed=3, limit=120).build()

    def run(policy: str) -> tuple[Simulation, dict[str, Any]]:
        sim = Simulation(wl, llama, 4, lambda probe: policy_profile(policy, probe, 7, llama, cfg), config=cfg)
        return sim, figures(sim.run())

    first, a = run("sglang_cache_aware")
    second, b = run("sglang_cache_aware")
    assert isinstance(first.peer, SGLangCacheAware) and first.peer is not second.peer
    assert a == b  # a fresh tree each run: the second run does not start from the first one's
    assert first.peer.tree.size("replica-0") > 0  # it learned from where its requests went
    rr, _ = run("round_robin")
    assert isinstance(rr.peer, RoundRobin) and rr.peer._next == len(wl)
