"""The cache estimate's trust moves on evidence only, and a session stays on a healthy, unloaded
replica whatever that replica's prefix counters do: never move, go backwards, jump or vanish."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.app.router import Router
from extproc.config import Config
from extproc.fleet.cache.estimate import CacheEstimate
from extproc.fleet.health.vllm_metrics import ReplicaMetrics
from extproc.request.features import RequestFeatures
from extproc.routing.model import AffinityView, Reason, Replica
from extproc.state.memory import MemoryStore


def _estimate() -> CacheEstimate:
    estimate = CacheEstimate(block_tokens=16, min_claimed_tokens=1000, decay=0.5, recovery_half_life_s=60.0)
    estimate.observe("r", 0.0, 0.0, now=0.0)
    return estimate


class Counters:
    """A replica's counters, advanced one scrape at a time: each scrape follows one request of
    5,000 prompt tokens of which the index claimed 4,000 cached."""

    def __init__(self, estimate: CacheEstimate) -> None:
        self.estimate, self.hits, self.queries, self.now = estimate, 0.0, 0.0, 0.0

    def scrapes(self, n: int, queried: float, hit: float) -> None:
        for _ in range(n):
            self.estimate.claimed("r", 4000, 5000)
            self.queries += queried
            self.hits += hit
            self.now += 1.0
            self.estimate.observe("r", self.hits, self.queries, now=self.now)


def test_counters_that_never_move_leave_trust_where_it_was() -> None:
    # Prefix caching off, a frozen or cached page, an engine that counts nothing: claims sent, the
    # counters stay. That is no evidence of eviction.
    estimate = _estimate()
    for i in range(20):
        estimate.claimed("r", 4000, 5000)
        estimate.observe("r", 0.0, 0.0, now=float(i))
    assert estimate.trust("r") == 1.0


def test_a_page_without_prefix_counters_leaves_trust_where_it_was() -> None:
    estimate = _estimate()
    for i in range(20):
        estimate.claimed("r", 4000, 5000)
        estimate.observe("r", None, None, now=float(i))
    assert estimate.trust("r") == 1.0


def test_queries_that_found_nothing_lower_trust() -> None:
    estimate = _estimate()
    Counters(estimate).scrapes(10, queried=5000, hit=0)
    assert estimate.trust("r") == estimate.min_trust


def test_claims_are_weighed_against_the_share_of_traffic_the_counters_cover() -> None:
    # The page lags, or counts only part of what was sent: half the prompt tokens were looked up,
    # and they found the claims of half the requests. Trust stays.
    estimate = _estimate()
    replica = Counters(estimate)
    replica.scrapes(10, queried=2500, hit=2000)
    assert estimate.trust("r") == 1.0
    # The same coverage, but what was looked up missed three quarters of the claims.
    replica.scrapes(20, queried=2500, hit=500)
    assert 0.2 < estimate.trust("r") < 0.3


def test_without_evidence_trust_recovers_with_time() -> None:
    estimate = _estimate()
    replica = Counters(estimate)
    replica.scrapes(10, queried=5000, hit=0)
    low = estimate.trust("r")
    estimate.recover(replica.now + 120.0)  # two half-lives without a word
    assert abs((1.0 - estimate.trust("r")) - (1.0 - low) / 4) < 1e-9
    # Fresh evidence counts as fresh: the faded history does not outvote it.
    replica.now += 120.0
    replica.scrapes(1, queried=5000, hit=4000)
    assert estimate.trust("r") > 1.0 - (1.0 - low) / 4


def test_a_counter_that_goes_backwards_is_a_new_baseline() -> None:
    estimate = _estimate()
    estimate.claimed("r", 4000, 5000)
    estimate.observe("r", 100.0, 10_000.0, now=1.0)  # a jump: 10,000 queries, 100 hits
    trust = estimate.trust("r")
    estimate.claimed("r", 4000, 5000)
    estimate.observe("r", 0.0, 0.0, now=2.0)  # restarted
    assert estimate.trust("r") == trust


def test_a_pin_is_judged_lost_only_on_the_replicas_word() -> None:
    estimate = _estimate()
    replica = Counters(estimate)
    view = AffinityView(pinned="r", prefix_matches={"r": 2, "s": 2})
    held = AffinityView(pinned="r", prefix_matches={"r": 30})
    # The index forgot the prompt, but the replica never counted a query: no evidence.
    replica.scrapes(10, queried=0, hit=0)
    assert estimate.judge_pin(view, 40).pin_lost is None
    # Its counters bear the index out: the index's eviction, within the size it reports, counts.
    replica.scrapes(10, queried=5000, hit=4000)
    assert estimate.trust("r") == 1.0
    assert estimate.judge_pin(view, 40).pin_lost == "capacity"
    assert estimate.judge_pin(held, 40).pin_lost is None
    replica.now += 600.0
    estimate.recover(replica.now)  # then its page stops moving for ten minutes
    assert estimate.judge_pin(view, 40).pin_lost is None
    # They report misses on what was sent there.
    replica.scrapes(10, queried=5000, hit=0)
    assert estimate.judge_pin(view, 40).pin_lost == "hit_counters"
    # Evidence fades without new evidence: after long enough silence the pin holds again.
    estimate.recover(replica.now + 600.0)
    assert estimate.judge_pin(view, 40).pin_lost is None


# --- through the router: sessions stay on a healthy, unloaded replica ---------------------------

REPLICAS = tuple(Replica(f"r{i}", f"127.0.0.1:{9000 + i}") for i in range(4))

counter_behaviour = st.sampled_from(["frozen", "backwards", "jump", "absent", "honest", "misses"])


def _metrics(hits: float | None, queries: float | None) -> ReplicaMetrics:
    fields: dict[str, Any] = {"num_gpu_blocks": 100_000, "block_size": 16, "prefix_hits": hits}
    fields["prefix_queries"] = queries
    return ReplicaMetrics(**fields)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    behaviours=st.lists(
        st.tuples(counter_behaviour, counter_behaviour, counter_behaviour, counter_behaviour), min_size=6, max_size=6
    )
)
def test_sessions_stay_whatever_the_prefix_counters_do(behaviours: list[tuple[str, ...]]) -> None:
    router = Router(Config(replicas=REPLICAS), store=MemoryStore())
    router.caches.estimate.min_claimed_tokens = 100
    counters = {r.name: [0.0, 0.0] for r in REPLICAS}
    pinned: dict[str, str] = {}
    now = 1.0
    for turn, kinds in enumerate(behaviours):
        for replica, kind in zip(REPLICAS, kinds, strict=True):
            c = counters[replica.name]
            if kind == "honest":
                c[0] += 2000.0
                c[1] += 2000.0
            elif kind == "misses":
                c[1] += 5000.0
            elif kind == "jump":
                c[0] += 1e9
                c[1] += 1e12
            elif kind == "backwards":
                c[0], c[1] = c[0] / 2, c[1] / 3
            if kind == "absent":
                router.replicas.apply_scrape(replica.name, _metrics(None, None), now)
            else:
                router.replicas.apply_scrape(replica.name, _metrics(c[0], c[1]), now)
        for s in range(8):
            session = f"s{s}"
            hashes = tuple(hash((session, i)) & ((1 << 62) - 1) for i in range(10 * (turn + 1)))
            features = RequestFeatures(
                path="/v1/chat/completions", session_key=session, prefix_hashes=hashes, prompt_chars=64 * len(hashes)
            )
            routed = router.effects.drive_now(router.core.place(features, now))
            assert routed.decision.replica is not None
            name = routed.decision.replica.name
            if session in pinned:
                assert name == pinned[session], (turn, session, routed.decision)
                assert routed.decision.reason is Reason.STICKY
            pinned[session] = name
            router.outcomes.observe_response(routed, 200)
            router.release(routed)
        now += 1.0
