"""Hot keys: the sampled, bucketed heavy-hitter detector and the hot-prefix stage of the decision."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc.adapters.admin.auth import MutationPolicy
from extproc.adapters.admin.console import ConsoleHistory
from extproc.adapters.admin.service import AdminService
from extproc.adapters.admin.tables import render
from extproc.adapters.telemetry import collect
from extproc.app.router import Routed, Router
from extproc.observe.hotkeys.detector import HotKeyDetector, HotKeySettings
from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, DecisionInputs, Replica, ReplicaState, Snapshot, build_profile, decide
from extproc.routing.hot import fingerprint
from tests.conftest import make_config

DEFAULT = HotKeySettings(enabled=True)


def stream(
    detector: HotKeyDetector, keys: list[str], weights: list[float], rps: float, seconds: float, seed: int
) -> float | None:
    """Feed ``rps`` requests a second drawn from ``keys`` by ``weights``; when a key was first hot."""
    rng = random.Random(seed)
    n = int(rps * seconds)
    first = None
    for i, key in enumerate(rng.choices(keys, weights, k=n)):
        now = i / rps
        detector.observe(key, 1000, now)
        if first is None and detector.hot():
            first = now
    detector.advance(seconds)
    if first is None and detector.hot():
        first = seconds
    return first


def test_a_key_at_ten_times_the_others_is_hot_within_two_windows() -> None:
    # 30 keys at one share each and one at ten: at 20,000 requests/s the hot one is sampled about
    # 250 times a 10-s window at 0.5%, the others about 25 times each (the bar: 8 x 25 = 200; at
    # fewer samples 10x against 8x is within the counts' noise).
    keys = [f"system-prompt-{i}" for i in range(30)] + ["hot"]
    weights = [1.0] * 30 + [10.0]
    for seed in range(3):
        detector = HotKeyDetector(DEFAULT, random.Random(seed))
        first = stream(detector, keys, weights, 20_000, 2 * DEFAULT.window_s, seed)
        assert first is not None and first <= 2 * DEFAULT.window_s, seed
        assert set(detector.hot()) == {fingerprint("hot")}
        hot = detector.hot()[fingerprint("hot")]
        assert 4_000 <= hot.rate_rps <= 6_000  # 10/40 of 20,000/s, from samples
        assert hot.tokens == 1000


def test_a_hot_key_cools_two_windows_after_its_share_drops() -> None:
    detector = HotKeyDetector(DEFAULT, random.Random(1))
    keys = [f"k{i}" for i in range(30)] + ["hot"]
    stream(detector, keys, [1.0] * 30 + [10.0], 20_000, 20, 1)
    assert detector.hot()
    # Then uniform: one window below the bar keeps it, the second cools it.
    rng = random.Random(2)
    for i in range(200_000):
        detector.observe(rng.choice(keys), 1000, 20 + i / 20_000)
    detector.advance(30)
    assert detector.hot(), "one window below the bar is not enough to cool"
    for i in range(200_000):
        detector.observe(rng.choice(keys), 1000, 30 + i / 20_000)
    detector.advance(40)
    assert not detector.hot()
    # Cooled, it keeps the replicas its own rate needs (645/s of 1,000 tokens: the cap, 4) ...
    assert dict(detector.table()) == {fingerprint("hot"): DEFAULT.max_replicas}
    # ... one once its traffic is gone, and after linger_windows it is routed as any other.
    detector.advance(50)
    assert dict(detector.table()) == {fingerprint("hot"): 1}
    detector.advance(40 + DEFAULT.linger_windows * DEFAULT.window_s + 1)
    assert not detector.table()


def test_a_key_without_traffic_cools() -> None:
    detector = HotKeyDetector(DEFAULT, random.Random(1))
    keys = [f"k{i}" for i in range(30)] + ["hot"]
    stream(detector, keys, [1.0] * 30 + [10.0], 20_000, 20, 1)
    assert detector.hot()
    detector.advance(1_000)
    assert not detector.hot() and not detector.table()


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    keys=st.integers(1, 400),
    rps=st.sampled_from([500, 3_000, 20_000]),
)
def test_a_uniform_stream_never_reports_a_hot_key(seed: int, keys: int, rps: int) -> None:
    detector = HotKeyDetector(DEFAULT, random.Random(seed))
    names = [f"{seed}-{i}" for i in range(keys)]
    assert stream(detector, names, [1.0] * keys, rps, 3 * DEFAULT.window_s, seed) is None


def _deep_size(obj: Any, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set):
        size += sum(_deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(_deep_size(getattr(obj, a), seen) for a in obj.__slots__ if hasattr(obj, a))
    return size


MEMORY_BOUND = 2 * 1024 * 1024
"""The detector's structures at most (1,024 buckets x 5 entries, masks, streaks, hot keys): 2 MiB."""


def test_memory_stays_bounded_at_a_million_distinct_keys() -> None:
    # Every request sampled (rate 1), so all million keys reach the sketch within one window.
    detector = HotKeyDetector(HotKeySettings(enabled=True, sample_rate=1.0), random.Random(0))
    for i in range(1_000_000):
        detector.observe(i, 100, i * 5e-6)
    size = _deep_size(detector._buckets) + _deep_size(detector._streak) + _deep_size(detector._hot)
    entries = sum(len(b.top) for b in detector._buckets.values())
    assert entries <= DEFAULT.buckets * DEFAULT.per_bucket
    assert size < MEMORY_BOUND, size
    assert not detector.hot()


# --- the hot-prefix stage of the decision --------------------------------------------------------


def _snapshot(n: int = 8, inflight: dict[str, int] | None = None) -> Snapshot:
    inflight = inflight or {}
    return Snapshot(
        tuple(
            ReplicaState(Replica(f"r{i}", f"127.0.0.1:{9000 + i}"), inflight=inflight.get(f"r{i}", 0)) for i in range(n)
        )
    )


def _features(question: int, session: str | None = None) -> RequestFeatures:
    # 40 blocks of a shared system prompt, then a block of its own: the ring key (block 32) is the prompt's.
    hashes = (*range(1, 41), 1000 + question)
    return RequestFeatures(
        path="/v1/chat/completions", model="m", prefix_hashes=hashes, prompt_chars=41 * 64, session_key=session
    )


def test_a_hot_prefix_spreads_over_its_k_replicas_on_the_ring() -> None:
    profile = build_profile()
    key = profile.prefix_key(_features(0))
    assert key is not None
    hot = {fingerprint(key): 3}
    ring = profile.ring_for(_snapshot())
    expected = ring.preference(key, 3)
    counts: Counter[str] = Counter()
    inflight: dict[str, int] = {}
    for q in range(18):  # 6 in flight on each of the 3: under the load bound (8 in flight at least)
        d = decide(DecisionInputs.of(_features(q), _snapshot(inflight=inflight), AffinityView(), 0.0, profile, hot=hot))
        assert d.replica is not None
        counts[d.replica.name] += 1
        inflight[d.replica.name] = inflight.get(d.replica.name, 0) + 1
    assert set(counts) == set(expected)
    assert max(counts.values()) - min(counts.values()) <= 1  # the least loaded of the k each time
    # Not hot (or cooled): the same requests stay on one replica while the fleet is idle.
    cold = {
        decide(DecisionInputs.of(_features(q), _snapshot(), AffinityView(), 0.0, profile)).replica.name
        for q in range(30)
    }  # type: ignore[union-attr]
    assert len(cold) == 1


def test_a_hot_prefix_set_walks_past_replicas_over_the_load_bound() -> None:
    profile = build_profile()
    key = profile.prefix_key(_features(0))
    assert key is not None
    first = profile.ring_for(_snapshot()).preference(key, 1)[0]
    d = decide(
        DecisionInputs.of(
            _features(1), _snapshot(inflight={first: 20}), AffinityView(), 0.0, profile, hot={fingerprint(key): 2}
        )
    )
    assert d.replica is not None and d.replica.name != first


def test_a_pinned_session_of_a_hot_prefix_stays_where_it_is() -> None:
    profile = build_profile()
    key = profile.prefix_key(_features(0))
    assert key is not None
    hot = {fingerprint(key): 2}
    outside = next(n for n in (f"r{i}" for i in range(8)) if n not in profile.ring_for(_snapshot()).preference(key, 2))
    view = AffinityView(pinned=outside, prefix_matches={outside: 41})
    d = decide(DecisionInputs.of(_features(1, "s"), _snapshot(), view, 0.0, profile, hot=hot))
    assert d.replica is not None and d.replica.name == outside


# --- the router: detection on live traffic, spreading, warming a joining replica ------------------


def _chat(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 50, "stream": True}).encode()


async def test_the_router_spreads_a_hot_prefix_and_warms_a_joining_replica_with_it() -> None:
    clock = [0.0]
    settings = HotKeySettings(
        enabled=True, sample_rate=1.0, window_s=1.0, min_samples=4, replica_prefill_tokens_per_s=5_000
    )
    replicas = tuple(Replica(f"r{i}", f"10.0.0.{i}:80") for i in range(8))
    router = Router(make_config(replicas=replicas, hot_keys=settings), clock=lambda: clock[0])
    sent: list[tuple[str, bytes]] = []

    async def send(address: str, path: str, body: bytes, timeout_s: float) -> int:
        sent.append((address, body))
        return 200

    router.rebalancer.prewarmer.send = send
    hot_system = "You are the support agent of a large shop. " * 80  # 3,500 characters: past block 32
    others = [f"Prompt {g}: " + f"another assistant number {g}. " * 100 for g in range(20)]
    headers = {":path": "/v1/chat/completions"}
    rng = random.Random(3)
    where: dict[int, Counter[str]] = {}
    inflight: deque[Routed] = deque()
    for i in range(600):  # 200 a second for 3 seconds: the hot prompt carries a third
        clock[0] = i / 200
        system = hot_system if i % 3 == 0 else rng.choice(others)
        routed = await router.route(headers, _chat(system, f"question {i}"))
        assert routed.decision.replica is not None
        if system is hot_system:
            where.setdefault(int(clock[0]), Counter())[routed.decision.replica.name] += 1
        inflight.append(routed)
        if len(inflight) > 12:  # each request takes 60 ms
            router.release(inflight.popleft())
    assert router.hot_keys is not None
    hot = list(router.hot_keys.hot().values())
    assert len(hot) == 1 and hot[0].replicas >= 2
    assert len(where[0]) <= 2  # before it is hot: affinity keeps it on the replica that holds it
    assert len(where[2]) == hot[0].replicas  # hot: its k replicas, the least loaded of them each time

    # The metric and the admin list name it by its fingerprint's hash, never by its text.
    collect(router)
    exposition = generate_latest(router.metrics.registry).decode()
    assert f'extproc_hot_key_replicas{{key="{hot[0].label}"}} {float(hot[0].replicas)}' in exposition
    assert "support agent" not in exposition
    listed = await AdminService(router, MutationPolicy()).ListHotKeys(pb.ListHotKeysRequest(), None)
    assert listed.enabled and [h.key for h in listed.hot_keys] == [hot[0].label]
    assert listed.hot_keys[0].replicas == hot[0].replicas and listed.hot_keys[0].warm_ready
    assert "support agent" not in render("hot-keys", listed) and hot[0].label in render("hot-keys", listed)
    console = ConsoleHistory(router).data()["hot_keys"]
    assert console == [{"key": hot[0].label, "rate": round(hot[0].rate_rps, 1), "replicas": hot[0].replicas}]

    # When it turned hot, the members new to its set (all but the one holding it and the one the
    # request itself went to) were warmed with it, once each.
    await router.rebalancer.prewarmer.drain()
    members = {f"10.0.0.{name[1:]}:80" for name in where[2]}
    warmed = [a for a, _ in sent]
    assert warmed and len(set(warmed)) == len(warmed) <= hot[0].replicas - 1, (warmed, members)
    assert set(warmed) <= members
    sent.clear()

    await router.fleet.set_replicas([*replicas, Replica("r9", "10.0.0.9:80")])
    await router.rebalancer.prewarmer.drain()
    assert [a for a, _ in sent] == ["10.0.0.9:80"]
    warm = json.loads(sent[0][1])
    assert warm["max_tokens"] == 1 and "stream" not in warm and warm["messages"][0]["content"] == hot_system


def test_the_hot_prefix_workload_has_one_prompt_over_one_replicas_prefill() -> None:
    from extproc_lab.replica.timing import get_profile
    from extproc_lab.sim.generators import hot_prefix

    wl = hot_prefix(duration_s=30.0)
    systems = Counter(r.messages[0]["content"] for r in wl.requests if r.messages)
    (top, count), *_ = systems.most_common(1)
    assert 0.40 <= count / len(wl) <= 0.60
    tokens = sum(r.prompt_tokens for r in wl.requests if r.messages and r.messages[0]["content"] == top) / count
    rate = count / 30.0
    assert rate * tokens > get_profile("llama-8b-h100").prefill_tokens_per_s  # its whole prompts, per second
    assert wl.info["changes"] == ((15.0, 10),)


def test_a_hot_keys_new_members_are_named_once_and_only_with_a_kept_request() -> None:
    detector = HotKeyDetector(HotKeySettings(enabled=True, sample_rate=1.0, window_s=1.0, min_samples=4))
    stream(detector, ["hot"] + [f"k{i}" for i in range(40)], [40.0] + [1.0] * 40, 400, 3.0, seed=1)
    fp = fingerprint("hot")
    assert fp in detector.hot()
    assert detector.newcomers(fp, ["a", "b"], holding=set()) == []  # nothing kept to warm them with
    detector.keep_exemplar(fp, "/v1/completions", b'{"prompt": "x"}')
    assert detector.exemplar(fp) == ("/v1/completions", b'{"prompt": "x"}')
    assert detector.newcomers(fp, ["a", "b", "c"], holding={"a"}) == ["b", "c"]
    assert detector.newcomers(fp, ["a", "b", "c", "d"], holding=set()) == ["d"]  # each once
