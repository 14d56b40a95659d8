"""KV pressure: the working-set figure, the bench's ``--kv-blocks`` levels, and the prefix index's
model of what a replica of a given capacity still holds."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.app.router import Router
from extproc.fleet.cache.estimate import CacheEstimate
from extproc.request.features import RequestFeatures
from extproc.routing.filters import OverloadFilter
from extproc.routing.model import AffinityView, Replica, ReplicaState, Snapshot
from extproc.routing.plugins import CycleState
from extproc.routing.ring import HashRing
from extproc.routing.scorers import PrefillCostScorer
from extproc.state.memory import PrefixIndex
from extproc_lab.bench.pressure import format_sweep, parse_levels, run_sweep
from extproc_lab.bench.routing import BenchSetup
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.pressure import working_set
from extproc_lab.sim.workload import SimRequest, Workload


def _req(i: int, keys: tuple[int, ...]) -> SimRequest:
    return SimRequest(index=i, arrival_s=float(i), prompt_tokens=16 * len(keys), output_tokens=1, keys=keys)


def test_working_set_counts_blocks_from_first_to_last_use() -> None:
    # Block 1 is used by requests 0..2 (live at 3 requests), block 2 by 0..1 (2), block 3 once (0).
    wl = Workload("w", [_req(0, (1, 2, 3)), _req(1, (1, 2)), _req(2, (1,)), _req(3, (9,))])
    p = working_set(wl, replicas=2, num_gpu_blocks=1)
    assert p.capacity_tokens == 32
    assert p.peak_live_tokens == 32
    assert p.mean_live_tokens == (32 + 32 + 16 + 0) / 4
    assert p.mean_ratio == 80 / 4 / 32


def test_parse_levels_rejects_nonsense() -> None:
    assert parse_levels("3000, 6000") == [3000, 6000]
    for bad in ("", "0", "-5,100"):
        try:
            parse_levels(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_a_sweep_runs_each_level_with_its_capacity() -> None:
    setup = BenchSetup(WorkloadSpec("multi-turn", limit=300), replicas=4)
    results = run_sweep(setup, [200, 4000], ["round_robin", "pooled"], show_progress=False)
    small, large = (r.workload for r in results)
    assert (small["kv_blocks_per_replica"], large["kv_blocks_per_replica"]) == (200, 4000)
    assert abs(small["working_set_ratio"] - 20 * large["working_set_ratio"]) < 0.01
    # Less cache, fewer hits, for the ceiling and for a real policy.
    hit = [{n: r.figures["hit_ratio"] for n, r in res.results.items()} for res in results]
    assert hit[0]["pooled"] < hit[1]["pooled"]
    assert hit[0]["round_robin"] < hit[1]["round_robin"]
    table = format_sweep(results)
    assert "| 200 |" in table and "| 4,000 |" in table


# --- the estimate against the replica model -------------------------------------------------


def _chain(parent: int, n: int, salt: int) -> list[int]:
    """``n`` chained block keys after ``parent``: a key names its whole prefix, as vLLM's do."""
    out = []
    for i in range(n):
        parent = hash((parent, salt, i)) & ((1 << 62) - 1)
        out.append(parent)
    return out


def _stream(rng: random.Random, requests: int) -> list[tuple[int, ...]]:
    """Prompts as block keys: conversations that grow turn by turn, some opening with one of a
    few shared system prompts, and one-off prompts."""
    systems = [_chain(0, rng.randint(4, 30), s) for s in range(3)]
    sessions: list[list[int]] = []
    out = []
    for k in range(requests):
        roll = rng.random()
        if sessions and roll < 0.6:
            conv = rng.choice(sessions)
            conv.extend(_chain(conv[-1], rng.randint(2, 12), k))
            out.append(tuple(conv))
        elif roll < 0.85:
            base = list(rng.choice(systems)) if rng.random() < 0.7 else []
            conv = base + _chain(base[-1] if base else k + 1, rng.randint(5, 60), k)
            sessions.append(conv)
            if len(sessions) > 40:
                sessions.pop(0)
            out.append(tuple(conv))
        else:
            out.append(tuple(_chain(k + 7, rng.randint(3, 80), -k)))
    return out


def _run_until_idle(model: ReplicaModel, now: float) -> float:
    while True:
        duration = model.begin_step(now, 1 << 20)
        if duration is None:
            return now
        now += duration
        model.end_step()


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(800, 3000),
    concurrency=st.integers(1, 4),
    output_tokens=st.integers(1, 200),
)
def test_the_estimate_forgets_what_a_replica_of_its_capacity_must_have_evicted(
    seed: int, num_blocks: int, concurrency: int, output_tokens: int
) -> None:
    """Random request streams through the replica model and, as the router records them, into
    the prefix index bounded by the capacity the replica reports: the index never claims more
    blocks than the replica holds, and at least 90% of what it claims is really cached. (The
    estimate keeps 10% of the cache for what running requests hold privately: up to 4 requests
    of 200 output tokens here, under 10% of 800 blocks.)"""
    rng = random.Random(seed)
    profile = dataclasses.replace(get_profile("llama-8b-h100"), num_gpu_blocks=num_blocks)
    model = ReplicaModel(profile)
    estimate = CacheEstimate(block_tokens=16)
    index = PrefixIndex(blocks_per_replica=10**9)  # unbounded unless the estimate says otherwise
    index.set_capacity("r", estimate.capacity_blocks(profile.num_gpu_blocks, profile.block_size))
    stream = _stream(rng, 300)
    now = 0.0
    checks = 0
    for start in range(0, len(stream), concurrency):
        for j, keys in enumerate(stream[start : start + concurrency]):
            if 16 * (len(keys) + 1) + output_tokens > 16 * num_blocks:
                continue  # vLLM refuses a request longer than its whole cache
            model.submit(Seq(f"q{start + j}", 16 * len(keys) + 5, output_tokens, keys), now)
            index.add("r", keys)
        now = _run_until_idle(model, now)
        claimed = index.held_blocks("r")
        assert len(claimed) <= num_blocks
        if len(claimed) >= num_blocks // 2:  # once the cache has filled enough to evict
            held = sum(1 for h in claimed if h in model.pool)
            assert held >= 0.9 * len(claimed), (held, len(claimed))
            checks += 1
    assert checks > 0 or sum(len(k) for k in stream) < num_blocks


def test_a_replica_whose_hit_counters_disagree_is_trusted_less() -> None:
    estimate = CacheEstimate(block_tokens=16, min_claimed_tokens=1000, decay=0.5)
    for r in ("honest", "liar"):
        estimate.observe(r, 0.0, num_gpu_blocks=1000, block_size=16)
    hits = {"honest": 0.0, "liar": 0.0}
    for _ in range(10):
        for r in ("honest", "liar"):
            estimate.claimed(r, 4000)
        hits["honest"] += 4000  # it found what the index claimed
        hits["liar"] += 1000  # a quarter: it evicted what the index still believes it holds
        for r, h in hits.items():
            estimate.observe(r, h)
    assert estimate.trust("honest") == 1.0
    assert 0.2 < estimate.trust("liar") < 0.3
    view = estimate.adjust(AffinityView(None, {"honest": 40, "liar": 40}))
    assert view.prefix_matches == {"honest": 40, "liar": int(40 * estimate.trust("liar"))}
    # A restart (counters back to zero) is a new baseline, not a collapse of trust.
    estimate.observe("liar", 0.0)
    assert 0.2 < estimate.trust("liar") < 0.3


def test_the_router_bounds_the_index_by_the_capacity_a_scrape_reports() -> None:
    from extproc.app.router import Router
    from extproc.config import Config
    from extproc.fleet.health.vllm_metrics import ReplicaMetrics
    from extproc.state.memory import MemoryStore

    config = Config(replicas=(Replica("a", "x:1"),))
    store = MemoryStore()
    router = Router(config, store=store)
    router.replicas.apply_scrape("a", ReplicaMetrics(num_gpu_blocks=100, block_size=16), 1.0)
    for i in range(10):
        hashes = tuple(_chain(i + 1, 30, i))
        features = RequestFeatures(path="/v1/completions", prefix_hashes=hashes, prompt_chars=64 * 30)
        router.effects.drive_now(router.core.place(features, 2.0 + i))
    # 100 blocks of 16 tokens, 90% of them for prompts: 90 index blocks, the last three prompts.
    assert store.prefixes.held("a") == 90


def test_a_claim_is_weighed_against_hits_only_once_the_request_is_prefilled() -> None:
    # Behind a queue the replica counts its hits seconds after the decision. Weighing claims from
    # the decision on made a replica that holds every claimed block look like one that evicted
    # them while its queue grew (shared-prefix at 12,000 blocks: trust fell to 0.2, the holders
    # were dropped as overloaded, hit ratio 55% where SGLang has 64%).
    from extproc.app.router import Router
    from extproc.config import Config
    from extproc.fleet.health.vllm_metrics import ReplicaMetrics
    from extproc.state.memory import MemoryStore

    router = Router(Config(replicas=(Replica("a", "x:1"),)), store=MemoryStore())
    router.caches.estimate.min_claimed_tokens = 100
    router.replicas.apply_scrape("a", ReplicaMetrics(num_gpu_blocks=1000, block_size=16, prefix_hits=0), 1.0)
    hashes = tuple(_chain(1, 30, 0))
    features = RequestFeatures(path="/v1/completions", prefix_hashes=hashes, prompt_chars=64 * 30)
    router.effects.drive_now(router.core.place(features, 2.0))  # the first sends the prompt: nothing claimed
    queued = [router.effects.drive_now(router.core.place(features, 3.0 + i)) for i in range(5)]
    assert all(r.claimed_tokens == 480 for r in queued)
    # Still queued at the next scrapes: no hits yet, and none expected.
    for t in (10.0, 11.0):
        router.replicas.apply_scrape("a", ReplicaMetrics(num_gpu_blocks=1000, block_size=16, prefix_hits=0), t)
        router.effects.drive_now(router.core.place(RequestFeatures(path="/v1/completions", prompt_chars=64), t))
    assert router.caches.estimate.trust("a") == 1.0
    # Prefilled: the first bytes came back, and the replica reports the hits.
    for r in queued[:3]:
        router.outcomes.observe_response(r, 200)
    for r in queued[3:]:
        router.release(r)
    assert all(r.claimed_tokens == 0 for r in queued)
    # It looked up all six prompts (the first one too) and found the five claims.
    router.replicas.apply_scrape(
        "a", ReplicaMetrics(num_gpu_blocks=1000, block_size=16, prefix_queries=6 * 480, prefix_hits=5 * 480), 12.0
    )
    router.effects.drive_now(router.core.place(RequestFeatures(path="/v1/completions", prompt_chars=64), 12.0))
    assert router.caches.estimate.trust("a") == 1.0
    # Had the replica looked them up and found none of it, trust would fall.
    for r in [router.effects.drive_now(router.core.place(features, 13.0 + i)) for i in range(5)]:
        router.outcomes.observe_response(r, 200)
    router.replicas.apply_scrape(
        "a", ReplicaMetrics(num_gpu_blocks=1000, block_size=16, prefix_queries=11 * 480, prefix_hits=5 * 480), 20.0
    )
    router.effects.drive_now(router.core.place(RequestFeatures(path="/v1/completions", prompt_chars=64), 20.0))
    assert router.caches.estimate.trust("a") < 0.7


# --- decisions under pressure -----------------------------------------------------------------


def _state(name: str, **kw: object) -> ReplicaState:
    return ReplicaState(Replica(name, f"h:{name}"), kv_capacity_tokens=48_000, **kw)  # type: ignore[arg-type]


def test_a_burst_does_not_herd_onto_the_one_replica_a_stale_scrape_shows_free() -> None:
    # The last scrape saw b at 80% with an empty queue, a at 95% with 3 waiting; since then the
    # router sent b prompts beyond its cache: those wait there. b is overloaded too: neither is
    # dropped, the scorers choose.
    flt = OverloadFilter(waiting_threshold=0)
    a = _state("a", kv_usage=0.95, queue=3, inflight_tokens=40_000)
    b = _state("b", kv_usage=0.80, inflight_tokens=60_000)
    cycle = CycleState(
        RequestFeatures(path="/v1/completions"), Snapshot((a, b)), AffinityView(), 0.0, HashRing(()), None
    )
    assert flt.filter(cycle, [a, b]) == [a, b]
    assert flt.waiting(b) == 12_000 / 256
    # Without what was sent since, b alone would have been kept.
    b_scraped_only = _state("b", kv_usage=0.80)
    assert flt.filter(cycle, [a, b_scraped_only]) == [b_scraped_only]
    # What it was sent short of its cache is running, not waiting: b is full, not overloaded.
    b_full = _state("b", kv_usage=0.80, inflight_tokens=47_000)
    assert flt.waiting(b_full) == 0 and flt.filter(cycle, [a, b_full]) == [b_full]


def test_a_full_cache_is_overloaded_only_with_work_waiting_for_room() -> None:
    # Under pressure a real engine's KV usage reads near 1 with running requests while it still
    # admits new ones as they finish: only a queue says new work would wait there.
    flt = OverloadFilter(waiting_threshold=0)
    assert not flt.overloaded(_state("a", kv_usage=0.97))
    assert not flt.overloaded(_state("a", kv_usage=0.97, inflight_tokens=45_000))  # ours running there
    assert flt.overloaded(_state("a", kv_usage=0.97, queue=1))
    assert flt.overloaded(_state("a", kv_usage=0.5, inflight_tokens=49_000))  # sent beyond its cache
    assert not flt.overloaded(_state("a", kv_usage=0.5, queue=5))  # waiting for the batch, not for room
    assert flt.overloaded(_state("a", kv_usage=0.1, queue=33))  # over queue_threshold whatever its KV
    # With a threshold: over it, not at it. The default's is 16: a few requests waiting at a full
    # engine are its normal state under pressure, left to the scorers' queued prefill.
    tolerant = OverloadFilter(waiting_threshold=2)
    assert not tolerant.overloaded(_state("a", kv_usage=0.97, queue=2))
    assert tolerant.overloaded(_state("a", kv_usage=0.97, queue=3))
    assert not OverloadFilter().overloaded(_state("a", kv_usage=0.97, queue=16))
    assert OverloadFilter().overloaded(_state("a", kv_usage=0.97, queue=17))
    # Through the filter: the full replica without a queue takes the new work, the queued one not.
    full, queued = _state("a", kv_usage=0.97), _state("b", kv_usage=0.97, queue=4)
    cycle = CycleState(
        RequestFeatures(path="/v1/completions"), Snapshot((full, queued)), AffinityView(), 0.0, HashRing(()), None
    )
    assert flt.filter(cycle, [full, queued]) == [full]
    assert cycle.overloaded == frozenset({"b"})
    assert "4.0 requests waiting" in flt.why(queued)


def test_prefill_cost_counts_the_kv_a_prompt_needs_beyond_the_cache() -> None:
    scorer = PrefillCostScorer(kv_weight=0.1, overflow_weight=1.0)
    hashes = tuple(range(100))
    f = RequestFeatures(path="/v1/completions", prefix_hashes=hashes, prompt_chars=4 * 6400)
    # a holds the whole prompt but its cache is full of running requests; b holds nothing, idle.
    a = _state("a", inflight_tokens=47_000)
    b = _state("b")
    view = AffinityView(prefix_matches={"a": 100})
    cycle = CycleState(f, Snapshot((a, b)), view, 0.0, HashRing(()), None)
    scores = scorer.score(cycle, [a, b])
    assert scores["b"] > scores["a"]
    # Without the KV terms the cached prompt wins.
    assert PrefillCostScorer().score(cycle, [a, b])["a"] > PrefillCostScorer().score(cycle, [a, b])["b"]


def test_a_replica_holding_most_of_the_prompt_is_judged_on_its_queue_not_its_full_cache() -> None:
    # a's cache is full of its conversations' running turns and it holds this prompt; b is as full
    # and holds nothing. Dropping a sends the turn cold to b, evicting b's conversations there.
    flt = OverloadFilter(waiting_threshold=0)
    f = RequestFeatures(path="/v1/completions", prefix_hashes=tuple(range(100)), prompt_chars=4 * 1600)
    a = _state("a", kv_usage=0.97, queue=2)
    b = _state("b", kv_usage=0.97, queue=2)
    c = _state("c", kv_usage=0.5)

    def kept(matches: dict[str, int], *candidates: ReplicaState) -> list[str]:
        view = AffinityView(prefix_matches=matches)
        cycle = CycleState(f, Snapshot(candidates), view, 0.0, HashRing(()), None)
        return [s.name for s in flt.filter(cycle, list(candidates))]

    assert kept({"a": 90}, a, b, c) == ["a", "c"]  # the holder stays; the full one holding nothing goes
    assert kept({"a": 40}, a, b, c) == ["c"]  # under half of the prompt: judged on its KV and queue like any other
    queued = _state("a", kv_usage=0.97, queue=40)
    assert kept({"a": 90}, queued, b, c) == ["c"]  # a holder whose queue is over the threshold still goes
    # A prefix most candidates hold (a shared system prompt) makes no holder: elsewhere it is cached too.
    assert kept({"a": 90, "b": 90, "c": 90}, a, b, c) == ["c"]
    assert kept({"a": 100, "b": 40, "c": 40}, a, b, c) == ["a", "c"]  # 60 blocks more than the others


def test_a_session_leaves_its_full_pin_only_where_its_queue_costs_more_than_recomputing_elsewhere() -> None:
    flt = OverloadFilter(waiting_threshold=0)
    f = RequestFeatures(
        path="/v1/chat/completions", session_key="s", prefix_hashes=tuple(range(100)), prompt_chars=4 * 1600
    )
    b = _state("b", kv_usage=0.97, queue=1)  # as full, holding nothing, work waiting: no place for the turn
    c = _state("c", kv_usage=0.5)

    def kept(
        a: ReplicaState, matches: dict[str, int] | None = None, lost: str | None = None, c: ReplicaState = c
    ) -> list[str]:
        # By default the index forgot the conversation (no matches): the pin alone says where it is.
        view = AffinityView(pinned="a", prefix_matches=matches or {}, pin_lost=lost)
        cycle = CycleState(f, Snapshot((a, b, c)), view, 0.0, HashRing(()), None)
        return [s.name for s in flt.filter(cycle, [a, b, c])]

    # A full KV alone is no evidence that waiting there costs more than recomputing 1,600 tokens.
    assert kept(_state("a", kv_usage=0.99)) == ["a", "c"]
    assert kept(_state("a", kv_usage=0.99, queue=1)) == ["a", "c"]
    # Requests waiting there are: each worth waiting_tokens (256) against what moving recomputes.
    assert kept(_state("a", kv_usage=0.99, queue=6)) == ["a", "c"]  # 1,536 < 1,600
    assert kept(_state("a", kv_usage=0.99, queue=7)) == ["c"]  # 1,792 > 1,600
    # ... beyond the queue where it would go: as long there, staying is cheaper.
    assert kept(_state("a", kv_usage=0.99, queue=7), c=_state("c", kv_usage=0.5, queue=2)) == ["a", "c"]
    # Its own word that the conversation is gone: it holds what the index says.
    assert kept(_state("a", kv_usage=0.99, queue=1), lost="kv_events") == ["c"]  # nothing: a queue drops it
    assert kept(_state("a", kv_usage=0.99), lost="kv_events") == ["a", "c"]  # full, nothing waiting: a candidate
    partly = {"a": 40, "b": 0, "c": 0}  # 640 tokens more than the others
    assert kept(_state("a", kv_usage=0.99, queue=2), partly, lost="kv_events") == ["a", "c"]  # 512 < 640
    assert kept(_state("a", kv_usage=0.99, queue=3), partly, lost="kv_events") == ["c"]  # 768 > 640
    # Over the queue threshold it goes whatever it holds; under the KV threshold it stays.
    assert kept(_state("a", kv_usage=0.5, queue=40)) == ["c"]
    assert kept(_state("a", kv_usage=0.5, queue=20)) == ["a", "c"]


def test_where_the_price_picks_a_pin_leaves_only_for_a_shorter_predicted_first_token() -> None:
    flt = OverloadFilter(waiting_threshold=0)
    f = RequestFeatures(
        path="/v1/chat/completions", session_key="s", prefix_hashes=tuple(range(100)), prompt_chars=4 * 1600
    )
    a = _state("a", kv_usage=0.97, queue=9)
    b = _state("b", kv_usage=0.5)
    view = AffinityView(pinned="a")
    for b_s, expected in ((0.5, ["a", "b"]), (0.1, ["b"])):
        cycle = CycleState(f, Snapshot((a, b)), view, 0.0, HashRing(()), None)
        cycle.price_ttft = lambda _c, s, b_s=b_s: 0.2 if s.name == "a" else b_s
        assert [s.name for s in flt.filter(cycle, [a, b])] == expected


def test_when_every_candidate_is_overloaded_none_is_marked_and_all_stay() -> None:
    flt = OverloadFilter(waiting_threshold=0)
    a = _state("a", kv_usage=0.97, queue=3)
    b = _state("b", kv_usage=0.97, queue=1)
    cycle = CycleState(
        RequestFeatures(path="/v1/completions"), Snapshot((a, b)), AffinityView(pinned="a"), 0.0, HashRing(()), None
    )
    assert flt.filter(cycle, [a, b]) == [a, b]
    assert cycle.overloaded == frozenset()  # a move then is the scores', not a spillover


def test_prefixes_in_flight_count_however_short_the_index_memory() -> None:
    from extproc.fleet.cache.inflight import InflightPrefixes, longer

    table = InflightPrefixes()
    long, short, other = tuple(range(1, 41)), tuple(range(1, 11)), (99, 100)
    table.add("a", long)
    table.add("a", short)
    table.add("b", short)
    assert table.matches(long) == {"a": 40, "b": 10}
    assert table.matches((*long, 41, 42)) == {"a": 40, "b": 10}
    assert table.matches(other) == {}
    table.remove("a", long)
    assert table.matches(long) == {"a": 10, "b": 10}
    assert longer({"a": 12}, table.matches(long)) == {"a": 12, "b": 10}
    table.remove("a", short)
    table.forget(["b"])
    assert table.matches(long) == {} and len(table) == 0

    # Through the router: the index holds one block of a replica's prompts (its capacity), but a
    # request still queued there covers the whole prompt until it ends.
    from extproc.config import Config
    from extproc.state.memory import MemoryStore

    router = Router(Config(replicas=(Replica("a", "x:1"),)), store=MemoryStore())
    router.store.set_capacity("a", 1)
    features = RequestFeatures(path="/v1/completions", prefix_hashes=tuple(_chain(1, 30, 0)), prompt_chars=64 * 30)
    first = router.effects.drive_now(router.core.place(features, 1.0))
    second = router.effects.drive_now(router.core.place(features, 2.0))
    assert second.decision.matched_blocks == 30
    router.release(first)
    third = router.effects.drive_now(router.core.place(features, 3.0))
    assert third.decision.matched_blocks == 30  # the second is still in flight
    router.release(second)
    router.release(third)
    assert router.effects.drive_now(router.core.place(features, 4.0)).decision.matched_blocks <= 1  # the index alone
