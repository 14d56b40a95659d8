"""With the price profile, the latency objectives judge by the price's predicted time to first
token and the prefill hop by the price's seconds (one prediction for every choice), not by
their own estimates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.base.engine_rates import PoolRates
from extproc.request.features import RequestFeatures
from extproc.routing.disagg import PairSettings
from extproc.routing.latency import TPOT_TERMS, TTFT_TERMS, LatencyFit, LatencyView
from extproc.routing.model import AffinityView, Decision, Replica, ReplicaState, Snapshot
from extproc.routing.pipeline import DecisionInputs, decide
from extproc.routing.registry import PRICE_PROFILE, SCORES_PROFILE, build_profile
from extproc.routing.roles import PairReason
from extproc.routing.trace import DecisionTrace

# A warm model that predicts 1 ms for anything: where it is used, every objective is met.
FAST_FIT = LatencyFit(
    ttft=(0.001,) + (0.0,) * (TTFT_TERMS - 1),
    tpot=(0.001,) + (0.0,) * (TPOT_TERMS - 1),
    ttft_warm=True,
    tpot_warm=True,
)
ROLE = "llm-d.ai/role"
CALIBRATED = (PoolRates({}),)
"""A pool prior for every replica (``health.engine_rates``, as ``extproc calibrate`` writes it),
at the built-in prior's rates: the objectives judge by the price only on rates measured for the
fleet, never on the built-in prior alone."""


def request() -> RequestFeatures:
    """A prompt of 250 blocks of 16 tokens (4,000 tokens), 100 output tokens, no session."""
    return RequestFeatures(
        path="/v1/chat/completions",
        model="m",
        prompt_chars=250 * 64,
        prefix_hashes=tuple(range(250)),
        max_output_tokens=100,
    )


def state(name: str, labels: dict[str, str] | None = None, **load: float) -> ReplicaState:
    return ReplicaState(Replica(name, f"{name}:8000", labels=labels or {}), **load)  # type: ignore[arg-type]


def decided(
    replicas: list[ReplicaState],
    spec: dict[str, object],
    slo_ttft_ms: float | None = None,
    latency: LatencyView | None = None,
    view: AffinityView | None = None,
) -> tuple[Decision, DecisionTrace]:
    features = replace(request(), slo_ttft_ms=slo_ttft_ms)
    trace = DecisionTrace()
    given = DecisionInputs.of(
        features,
        Snapshot(tuple(replicas)),
        view or AffinityView(),
        0.0,
        build_profile(spec),
        latency=latency,
        pairing=PairSettings(block_tokens=16),
        block_chars=64,
    )
    return decide(given, trace), trace


def test_with_the_price_the_objectives_judge_by_the_prices_ttft() -> None:
    # Two cold replicas, one with a long prefill queue; the warm fits say 1 ms everywhere.
    replicas = [state("a"), state("b", pending_prefill_tokens=40_000)]
    latency = LatencyView(fits={"a": FAST_FIT, "b": FAST_FIT}, priors=CALIBRATED)
    d, trace = decided(replicas, PRICE_PROFILE, slo_ttft_ms=1_000.0, latency=latency)
    for name, price in trace.prices.items():
        assert trace.predicted[name].ttft_s == pytest.approx(price.ttft_s)
        assert trace.predicted[name].tpot_s == pytest.approx(0.001)  # TPOT stays the fit's
    best = max(1.0 - p.ttft_s for p in trace.prices.values())
    assert d.objective_headroom == pytest.approx(best) and not d.objective_missed
    # An objective below every candidate's priced TTFT is missed (the shedding acts on this),
    # though the fits would have called it met.
    tight = min(p.ttft_s for p in trace.prices.values()) * 1000.0 / 2
    d, _ = decided(replicas, PRICE_PROFILE, slo_ttft_ms=tight, latency=latency)
    assert d.objective_missed and d.objective_headroom == pytest.approx(-1.0)
    # The scores profile judges by its fits.
    d, trace = decided(replicas, SCORES_PROFILE, slo_ttft_ms=tight, latency=latency)
    assert not trace.prices and not d.objective_missed


def test_with_the_price_the_objectives_judge_without_any_warm_fit() -> None:
    # No latency model at all: the price still predicts (from the pool's prior), so a request
    # with an objective is judged rather than routed as if it had none.
    replicas = [state("a"), state("b")]
    d, trace = decided(replicas, PRICE_PROFILE, slo_ttft_ms=1_000.0, latency=LatencyView(priors=CALIBRATED))
    assert set(trace.predicted) == {"a", "b"} and trace.predicted["a"].tpot_s is None
    assert d.objective_headroom is not None and not d.objective_missed
    d, _ = decided(replicas, SCORES_PROFILE, slo_ttft_ms=1_000.0)
    assert d.objective_headroom is None


def test_on_the_built_in_prior_alone_an_objective_is_not_judged() -> None:
    # Nothing measured of the fleet (no pool prior, nothing learnt): the built-in prior is an
    # H100's, no evidence that these replicas miss an objective, so nothing is shed on it.
    replicas = [state("a"), state("b")]
    d, trace = decided(replicas, PRICE_PROFILE, slo_ttft_ms=0.001)
    assert trace.predicted["a"].ttft_s is None and trace.prices["a"].rates.source == "prior"
    assert d.objective_headroom is None and not d.objective_missed
    # With the pool's prior the same objective is judged, and missed.
    d, _ = decided(replicas, PRICE_PROFILE, slo_ttft_ms=0.001, latency=LatencyView(priors=CALIBRATED))
    assert d.objective_missed


def test_with_the_price_the_prefill_hop_goes_where_the_price_is_least() -> None:
    # p1 has the fewer tokens queued, but 600 running requests: the price has the prompt prefill
    # there in chunks of what those leave of a step, each step paying their decode. p2 has more
    # queued and nothing running. The token count picks p1; the price p2. The decode replica has
    # a long prefill queue of its own: both hop.
    decode = state("d", {ROLE: "decode"}, running=2, pending_prefill_tokens=10_000)
    p1 = state("p1", {ROLE: "prefill"}, pending_prefill_tokens=500, running=600, kv_capacity_tokens=65_536)
    p2 = state("p2", {ROLE: "prefill"}, pending_prefill_tokens=1_500, kv_capacity_tokens=65_536)
    d, _ = decided([decode, p1, p2], SCORES_PROFILE)
    assert d.pair is PairReason.DISAGGREGATED and d.prefill is not None and d.prefill.name == "p1"
    d, _ = decided([decode, p1, p2], PRICE_PROFILE)
    assert d.pair is PairReason.DISAGGREGATED and d.prefill is not None and d.prefill.name == "p2"


def test_with_the_price_the_decode_replica_prefills_itself_when_that_is_cheaper() -> None:
    # The decode replica holds nothing and decodes 10 requests; the only prefill replica has 3,500
    # tokens queued. The token count weighs the stall of the decode batch (4,000 tokens x 2)
    # above the queue (3,500 + 4,000) and hops; the price: the queue delays the first token more
    # than prefilling in chunks beside that batch's decode, the batch's stall (`others`) included.
    decode = state("d", {ROLE: "decode"}, running=10)
    p = state("p", {ROLE: "prefill"}, pending_prefill_tokens=3_500)
    d, _ = decided([decode, p], SCORES_PROFILE)
    assert d.pair is PairReason.DISAGGREGATED
    d, trace = decided([decode, p], PRICE_PROFILE)
    assert d.pair is PairReason.LOCAL, trace.prices


def test_the_objectives_and_the_picker_price_an_adapter_alike() -> None:
    # "b" lists no models and does not hold the adapter: whether "sql" is an adapter is judged
    # over the fleet ("a" holds it), once, for the picker's prices and the objectives' alike.
    held = ReplicaState(Replica("a", "a:8000"), adapters=frozenset({"sql"}), max_lora=2)
    bare = ReplicaState(Replica("b", "b:8000"), max_lora=2)
    features = replace(request(), model="sql", slo_ttft_ms=60_000.0)
    trace = DecisionTrace()
    given = DecisionInputs.of(
        features,
        Snapshot((held, bare)),
        AffinityView(),
        0.0,
        build_profile(PRICE_PROFILE),
        latency=LatencyView(priors=CALIBRATED),
        block_chars=64,
    )
    decide(given, trace)
    assert trace.prices["b"].adapter_s > 0.0 and trace.prices["a"].adapter_s == 0.0
    for name, price in trace.prices.items():
        assert trace.predicted[name].ttft_s == pytest.approx(price.ttft_s)
