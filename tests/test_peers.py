"""The peer routers' policies, as pipeline plugins, behave as their projects publish."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.pipeline import Profile
from extproc.routing.plugins import CycleState
from extproc.routing.ring import HashRing
from extproc_lab.peers import (
    PEER_REGISTRY,
    ApproximateTree,
    DynamoCostPicker,
    KVCacheUtilizationScorer,
    MatchFractionScorer,
    QueueScorer,
    SGLangCacheAwarePicker,
)

NAMES = ("a", "b", "c", "d")


def peer_profile(spec: Mapping[str, object]) -> Profile:
    """A profile that may name the peers' plugins."""
    return build_profile(spec, registry=PEER_REGISTRY)


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


def pick(
    policy: str, snap: tuple[ReplicaState, ...], f: RequestFeatures, view: AffinityView | None = None, **params: object
) -> str:
    profile = peer_profile({"filters": [], "scorers": [], "picker": {"type": policy, "parameters": params}})
    d = decide(f, Snapshot(snap), view or AffinityView(), 0.0, profile)
    assert d.replica is not None
    return d.replica.name


def cycle(snap: tuple[ReplicaState, ...], f: RequestFeatures, view: AffinityView | None = None) -> CycleState:
    ring = HashRing([(n, 1.0) for n in NAMES])
    return CycleState(f, Snapshot(snap), view or AffinityView(), 0.0, ring, f.session_key)


def test_round_robin_cycles_through_replicas_in_order() -> None:
    profile = peer_profile({"filters": [], "scorers": [], "picker": {"type": "round_robin"}})
    chosen = [decide(features(), Snapshot(states()), AffinityView(), 0.0, profile).replica for _ in range(8)]
    assert [r.name for r in chosen if r] == list("abcdabcd")


@pytest.mark.parametrize("policy", ["random", "least_request", "power_of_two"])
def test_randomised_pickers_are_seeded_not_clock_driven(policy: str) -> None:
    def run(seed: int) -> list[str]:
        profile = peer_profile({"filters": [], "scorers": [], "picker": {"type": policy, "parameters": {"seed": seed}}})
        return [str(decide(features(), Snapshot(states()), AffinityView(), 0.0, profile).replica) for _ in range(20)]

    assert run(3) == run(3)
    assert len(set(run(3))) > 1  # ties and draws spread over replicas
    rng = random.Random(5)
    assert pick(policy, states(), features(), rng=rng) in NAMES


def test_least_request_and_power_of_two_avoid_the_busy() -> None:
    busy = states(inflight={"a": 9, "b": 9, "c": 0, "d": 9}, running={"a": 9, "b": 9, "c": 0, "d": 9})
    assert all(pick("least_request", busy, features(), seed=s) == "c" for s in range(10))
    # Power of two never picks the busier of its two draws (the draws recorded as they are made).
    loads = {"a": 9, "b": 5, "c": 0, "d": 7}
    spread = states(inflight=loads, running=loads)
    for seed in range(60):
        rng = RecordingRandom(seed)
        chosen = pick("power_of_two", spread, features(), rng=rng)
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
    overloaded = states(inflight={"a": 500, "b": 500, "c": 500, "d": 500})
    first = pick("consistent_hash", states(), features("s-1"))
    assert all(pick("consistent_hash", overloaded, features("s-1", request_id=f"x{i}")) == first for i in range(5))
    spread = Counter(pick("consistent_hash", states(), features(f"s-{i}")) for i in range(200))
    assert len(spread) == 4 and min(spread.values()) > 20
    # Without a session key the request id is the key: requests spread.
    assert len({pick("consistent_hash", states(), features(None, request_id=f"q{i}")) for i in range(50)}) > 1


def test_sglang_cache_aware_thresholds() -> None:
    picker = SGLangCacheAwarePicker()
    snap = states()
    doc = features(blocks=20)
    first = picker.pick(cycle(snap, doc), snap, {})[0].name
    # Smallest tree for a prompt it has never seen; then the holder of a prefix matching > 30%.
    assert picker.tree.size(first) == 20
    again = features(blocks=20, request_id="r2")
    assert picker.pick(cycle(snap, again), snap, {})[0].name == first
    short_match = RequestFeatures(
        path="/v1/chat/completions", prompt_chars=100 * 64, prefix_hashes=(1, 2, 3, *range(500, 597)), request_id="r3"
    )
    assert picker.pick(cycle(snap, short_match), snap, {})[0].name != first  # 3% match: smallest tree
    # A spread of 50 in flight is under the absolute threshold (64): the cache still decides.
    mild = states(inflight={n: 10 if n != first else 60 for n in NAMES})
    assert picker.pick(cycle(mild, again), mild, {})[0].name == first
    # Imbalance over both thresholds: the least loaded, whatever the cache says.
    skewed = states(inflight={n: 10 if n == "c" else 100 for n in NAMES})
    assert picker.pick(cycle(skewed, again), skewed, {})[0].name == "c"


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
    view = AffinityView(prefix_matches={"c": 128, "d": 300})
    c = cycle(snap, f, view)
    assert QueueScorer().score(c, snap) == {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.0}
    assert KVCacheUtilizationScorer().score(c, snap)["a"] == pytest.approx(0.1)
    assert MatchFractionScorer().score(c, snap) == {"a": 0.0, "b": 0.0, "c": 0.5, "d": 1.0}
    assert QueueScorer().score(c, states()) == dict.fromkeys(NAMES, 1.0)
    profile = peer_profile(
        {
            "filters": [],
            "scorers": [
                {"type": "gie_queue", "weight": 2},
                {"type": "gie_kv_cache", "weight": 2},
                {"type": "gie_prefix", "weight": 3},
            ],
            "picker": {"type": "gie_max_score", "parameters": {"seed": 1}},
        }
    )
    d = decide(f, Snapshot(snap), view, 0.0, profile)
    assert d.replica is not None and d.replica.name == "d"  # 0 + 2 + 3 beats a's 2 + 0.2 + 0


class FixedProbe:
    def __init__(self, cached: Mapping[str, int], active: Mapping[str, int]) -> None:
        self.cached, self.active = cached, active

    def cached_tokens(self, features: RequestFeatures) -> Mapping[str, int]:
        return self.cached

    def active_blocks(self) -> Mapping[str, int]:
        return self.active


def test_dynamo_cost_trades_prefill_saved_against_decode_load() -> None:
    f = features(blocks=400)  # 6,400 tokens: 400 blocks of 16
    snap = states()
    probe = FixedProbe({"a": 6400}, {"a": 300, "b": 0, "c": 0, "d": 0})
    picker = DynamoCostPicker(probe=probe)
    costs = picker.costs(cycle(snap, f), snap)
    assert costs["a"] == pytest.approx(0 + 300 + 400)
    assert costs["b"] == pytest.approx(400 + 0 + 400)
    assert picker.pick(cycle(snap, f), snap, {})[0].name == "a"
    busy = FixedProbe({"a": 6400}, {"a": 900, "b": 0, "c": 0, "d": 0})
    assert DynamoCostPicker(probe=busy).pick(cycle(snap, f), snap, {})[0].name == "b"
    # Without KV events: the store's approximate index and the scraped KV usage.
    approx = DynamoCostPicker(num_gpu_blocks=1000)
    view = AffinityView(prefix_matches={"c": 400})
    kv = states(kv_usage={"a": 0.0, "b": 0.0, "c": 0.2, "d": 0.0})
    assert approx.pick(cycle(kv, f, view), kv, {})[0].name == "c"


def test_oracle_follows_the_true_cache_and_needs_a_probe() -> None:
    probe = FixedProbe({"b": 320, "c": 640}, {})
    assert pick("oracle", states(), features(), probe=probe) == "c"
    with pytest.raises(ValueError, match="oracle"):
        peer_profile({"filters": [], "scorers": [], "picker": {"type": "oracle"}})
