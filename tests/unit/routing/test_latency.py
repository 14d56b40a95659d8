"""Each replica's latency model (learned online) and routing to a latency objective."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.config import Config
from extproc.fleet.health.latency import LatencyBook
from extproc.fleet.health.settings import HealthSettings
from extproc.request.features import RequestFeatures
from extproc.routing import (
    SCORES_PROFILE,
    AffinityView,
    DecisionInputs,
    Replica,
    ReplicaState,
    Snapshot,
    build_profile,
    decide,
)
from extproc.routing.latency import LatencyFit, LatencyView, LoadPoint, verdict
from extproc.routing.plugins import CycleState
from extproc.routing.slo import SloHeadroomScorer
from extproc.routing.trace import DecisionTrace
from extproc_lab.bench.policies import policy_profile
from extproc_lab.replica.timing import get_profile
from extproc_lab.sim.generators import multi_turn
from extproc_lab.sim.simulator import Simulation


def true_ttft(p: LoadPoint) -> float:
    return 0.01 + (p.uncached_tokens + p.queued_prefill_tokens) / 20_000 + 0.0005 * p.running + 0.02 * p.kv_usage


def point(rng: random.Random) -> LoadPoint:
    return LoadPoint(rng.uniform(0, 4000), rng.uniform(0, 8000), rng.randrange(0, 64), rng.random())


def test_a_model_starts_cold_from_its_prior_and_warms_after_enough_observations() -> None:
    book = LatencyBook(warm_after=8)
    assert book.view().fits == {}
    rng = random.Random(1)
    for _ in range(8):
        assert "r0" not in book.view().fits or not book.view().fits["r0"].ttft_warm
        book.observe_ttft("r0", point(rng), 0.05)
    fit = book.view().fits["r0"]
    assert fit.ttft_warm and fit.ttft_samples == 8 and not fit.tpot_warm
    assert fit.ttft_error is None  # errors are counted from the first warm prediction on


def test_the_fit_learns_a_replicas_ttft_to_a_few_percent() -> None:
    book = LatencyBook()
    rng = random.Random(2)
    for _ in range(400):
        p = point(rng)
        book.observe_ttft("r0", p, true_ttft(p) * rng.uniform(0.97, 1.03))
    fit = book.view().fits["r0"]
    assert fit.ttft_error is not None and fit.ttft_error < 0.05
    for _ in range(50):
        p = point(rng)
        assert abs(fit.ttft_s(p) - true_ttft(p)) / true_ttft(p) < 0.1
    # Its state is bounded: the error window keeps its size however long it runs.
    assert len(book._replicas["r0"].ttft.errors) == book.error_window


def test_a_term_that_never_varies_does_not_blow_up_the_fit() -> None:
    book = LatencyBook(forget=0.99)
    rng = random.Random(3)
    for _ in range(3000):
        p = LoadPoint(rng.uniform(0, 4000), 0.0, 0.0, 0.0)  # no queue, no batch, no KV ever
        book.observe_ttft("r0", p, true_ttft(p))
    fit = book.view().fits["r0"]
    p = LoadPoint(1000, 0, 0, 0)
    assert abs(fit.ttft_s(p) - true_ttft(p)) / true_ttft(p) < 0.05
    assert max(abs(c) for c in fit.ttft) < 10


def test_on_the_simulators_replicas_predictions_are_within_20_percent_at_the_median() -> None:
    replica = get_profile("llama-8b-h100")
    cfg = Config(health=HealthSettings(latency_models="always"))  # no request here states an objective
    sim = Simulation(
        multi_turn(120, seed=5), replica, 4, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg
    )
    sim.run()
    fits = sim.driver.latency_fits()
    assert set(fits) == set(sim.names)
    for fit in fits.values():
        assert fit.ttft_warm and fit.tpot_warm
        assert fit.ttft_error is not None and fit.ttft_error < 0.2
        assert fit.tpot_error is not None and fit.tpot_error < 0.2


# --- routing to an objective ------------------------------------------------------------------


CHAT = "/v1/chat/completions"


def fit(ttft_s: float, per_kilotoken_s: float = 0.05, warm: bool = True) -> LatencyFit:
    """A fit predicting ``ttft_s`` plus ``per_kilotoken_s`` per thousand uncached tokens, 10 ms TPOT."""
    return LatencyFit(
        ttft=(ttft_s, per_kilotoken_s, per_kilotoken_s, 0, 0, 0, 0),
        tpot=(0.01, 0, 0, 0),
        ttft_samples=100,
        tpot_samples=100,
        ttft_warm=warm,
        tpot_warm=warm,
    )


def inputs(
    fits: dict[str, LatencyFit],
    *,
    ttft_ms: float | None = 200.0,
    tpot_ms: float | None = None,
    view: AffinityView | None = None,
    hashes: tuple[int, ...] = (),
    **states: dict[str, object],
) -> DecisionInputs:
    replicas = tuple(
        ReplicaState(Replica(n, f"127.0.0.1:{9000 + i}"), **states.get(n, {}))  # type: ignore[arg-type]
        for i, n in enumerate(["r0", "r1", "r2", "r3"])
    )
    features = RequestFeatures(
        path=CHAT,
        model="m",
        session_key="s",
        prefix_hashes=hashes,
        prompt_chars=len(hashes) * 64,
        slo_ttft_ms=ttft_ms,
        slo_tpot_ms=tpot_ms,
    )
    return DecisionInputs.of(
        features,
        Snapshot(replicas),
        view or AffinityView(),
        0.0,
        # The objectives judged by the latency models' fits (the scores profile's way): under the
        # price they judge by the price's own prediction (test_price_objectives.py).
        build_profile(SCORES_PROFILE),
        latency=LatencyView(fits),
    )


def chosen(inputs: DecisionInputs) -> str:
    d = decide(inputs)
    assert d.replica is not None
    return d.replica.name


def test_without_warm_models_or_objectives_the_decision_is_todays() -> None:
    pinned = AffinityView(pinned="r2")
    today = chosen(replace(inputs({}, view=pinned), latency=None))
    assert today == "r2"
    cold = {n: fit(1.0, warm=False) for n in ("r0", "r1", "r2", "r3")}
    assert chosen(inputs(cold, view=pinned)) == today
    slow = {n: fit(1.0) for n in ("r0", "r1", "r2", "r3")}
    assert chosen(inputs(slow, view=pinned, ttft_ms=None)) == today
    # Every warm candidate would miss: none is removed, the pin holds.
    assert chosen(inputs(slow, view=pinned)) == today


def test_a_pinned_replica_predicted_to_miss_is_left_for_one_that_meets_the_objective() -> None:
    fits = {"r0": fit(0.05), "r1": fit(0.05), "r2": fit(0.5), "r3": fit(0.05)}
    at = inputs(fits, view=AffinityView(pinned="r2"))
    assert chosen(at) != "r2"
    trace = DecisionTrace()
    d = decide(at, trace)
    assert d.moved_by == "slo"
    assert ("r2", "predicted to miss the request's latency objectives") in trace.filters[-1].removed
    assert trace.predicted["r2"].ttft_s == pytest.approx(0.5)
    # A cold replica is neither removed nor preferred.
    fits["r1"] = fit(0.05, warm=False)
    trace = DecisionTrace()
    decide(inputs(fits, view=AffinityView(pinned="r2")), trace)
    assert "r1" not in trace.predicted and "r1" in trace.totals


def test_the_cache_still_decides_among_replicas_that_meet_and_headroom_breaks_its_ties() -> None:
    hashes = tuple(range(32))  # 512 tokens
    fits = {"r0": fit(0.02), "r1": fit(0.08), "r2": fit(0.05), "r3": fit(0.15)}
    # r1 holds the whole prompt: its prefill is free, and it still meets 200 ms.
    held = AffinityView(prefix_matches={"r1": 32})
    assert chosen(inputs(fits, view=held, hashes=hashes)) == "r1"
    # Nobody holds it: the most headroom wins.
    assert chosen(inputs(fits, hashes=hashes)) == "r0"


def test_a_tpot_objective_keeps_requests_off_replicas_whose_decode_is_too_slow() -> None:
    slow_decode = replace(fit(0.02), tpot=(0.05, 0, 0, 0))
    fits = {"r0": slow_decode, "r1": fit(0.02), "r2": fit(0.02), "r3": fit(0.02)}
    assert chosen(inputs(fits, view=AffinityView(pinned="r0"), ttft_ms=None, tpot_ms=20)) != "r0"


@given(
    st.lists(st.tuples(st.floats(0, 5), st.floats(-1, 1), st.floats(0, 0.2), st.booleans()), min_size=4, max_size=4),
    st.one_of(st.none(), st.floats(1, 10_000)),
    st.one_of(st.none(), st.floats(1, 1_000)),
    st.lists(st.integers(0, 100_000), min_size=4, max_size=4),
)
def test_the_headroom_scorers_raw_scores_lie_in_0_1(
    models: list[tuple[float, float, float, bool]],
    ttft_ms: float | None,
    tpot_ms: float | None,
    queued: list[int],
) -> None:
    fits = {
        f"r{i}": replace(fit(base, slope, warm=warm), tpot=(tpot, 0, 0, 0))
        for i, (base, slope, tpot, warm) in enumerate(models)
    }
    states = {f"r{i}": {"pending_prefill_tokens": q} for i, q in enumerate(queued)}
    given_ = inputs(fits, ttft_ms=ttft_ms, tpot_ms=tpot_ms, hashes=tuple(range(8)), **states)
    cycle = CycleState(
        given_.features,
        given_.snapshot,
        given_.view,
        0.0,
        given_.profile.ring_for(given_.snapshot),
        None,
        latency=given_.latency,
    )
    scores = SloHeadroomScorer().score(cycle, given_.snapshot.replicas)
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    if (ttft_ms is None and tpot_ms is None) or not any(w for *_, w in models):
        assert scores == {}


def test_a_decision_says_it_misses_only_when_every_candidate_is_predicted_to() -> None:
    slow = {n: fit(0.5) for n in ("r0", "r1", "r2", "r3")}
    assert decide(inputs(slow)).objective_missed
    # One replica that meets it, or one whose model is cold (it might), and it is not a miss.
    assert not decide(inputs({**slow, "r3": fit(0.05)})).objective_missed
    assert not decide(inputs({**slow, "r3": fit(0.5, warm=False)})).objective_missed
    # Without objectives, or with an objective no warm model predicts (TPOT here), never.
    assert not decide(inputs(slow, ttft_ms=None)).objective_missed
    tpot_cold = {n: replace(f, tpot_warm=False) for n, f in slow.items()}
    assert not decide(inputs(tpot_cold, ttft_ms=None, tpot_ms=5)).objective_missed
    # A replica another filter removed does not count: the candidates left all miss.
    assert decide(inputs({**slow, "r3": fit(0.05)}, r3={"in_rotation": False, "health": 0.0})).objective_missed


def test_the_verdict_names_the_least_late_candidate_and_its_predictions() -> None:
    slow = {"r0": fit(0.5), "r1": fit(0.3), "r2": fit(0.9), "r3": fit(0.4)}
    trace = DecisionTrace()
    d = decide(inputs(slow), trace)
    outcome, why = verdict(d_features(slow), trace.predicted, d.objective_missed)
    assert outcome == "missed" and "r1" in why and "TTFT 300 ms of 200" in why
    outcome, why = verdict(d_features(slow, ttft_ms=400), trace.predicted, False)
    assert outcome == "met" and "r1" in why
    assert verdict(d_features(slow), {}, False)[0] == "unknown"
    assert verdict(d_features(slow, ttft_ms=None), trace.predicted, False)[0] == ""


def d_features(fits: dict[str, LatencyFit], ttft_ms: float | None = 200.0) -> RequestFeatures:
    return inputs(fits, ttft_ms=ttft_ms).features


def test_error_quantiles_are_the_windows_nearest_ranks() -> None:
    book = LatencyBook(warm_after=4, error_window=16)
    rng = random.Random(4)
    assert book.error_quantiles("r0") == {}
    for _ in range(40):
        book.observe_ttft("r0", point(rng), rng.uniform(0.05, 0.5))
    window = sorted(book._replicas["r0"].ttft.errors)
    assert len(window) == 16
    p50, p90 = book.error_quantiles("r0")["ttft"]
    assert p50 == window[round(0.5 * 15)] and p90 == window[round(0.9 * 15)]
    assert "tpot" not in book.error_quantiles("r0")


@pytest.mark.parametrize(
    ("mode", "learns_before", "learns_after"),
    [("auto", False, True), ("always", True, True), ("off", False, False)],
)
async def test_the_models_learn_only_where_objectives_are_in_use(
    mode: str, learns_before: bool, learns_after: bool
) -> None:
    from extproc.app.router import Router
    from tests.conftest import chat_body, make_config

    router = Router(make_config(health=HealthSettings(latency_models=mode)))  # type: ignore[arg-type]

    async def one(headers: dict[str, str]) -> bool:
        routed = await router.route({":path": "/v1/chat/completions", **headers}, chat_body("a prompt " * 40))
        assert routed.decision.replica is not None
        router.outcomes.observe_response(routed, 200, timed=True)
        router.outcomes.tokens_over(routed, None, None, 1)  # a one-token answer: its first token with its headers
        router.release(routed)
        return bool(router.latency.view().fits)

    assert await one({}) is learns_before
    await one({"x-slo-ttft-ms": "500"})  # the first objective: auto learns from this request on
    assert await one({}) is learns_after


def test_the_fit_stays_on_the_mean_when_the_noise_grows_with_the_latency() -> None:
    # Latencies scattered around 50 ms by a factor with mean 1 (a busy replica's steps): a fit that
    # weighs each observation by its own size settles far below the mean (about half of it here)
    # and every objective looks met; weighed by its prediction, it stays near the mean.
    book = LatencyBook()
    rng = random.Random(11)
    p = LoadPoint(0, 0, 8, 0.5)
    for _ in range(2000):
        book.observe_tpot("r0", p, 0.05 * rng.uniform(0.2, 1.8))
    assert book.view().fits["r0"].tpot_s(p) == pytest.approx(0.05, rel=0.1)
