"""Each replica's latency model (learned online) and routing to a latency objective."""

from __future__ import annotations

import random

from extproc.config import Config
from extproc.health.latency import LatencyBook
from extproc.routing.latency import LoadPoint
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
    cfg = Config()
    sim = Simulation(
        multi_turn(120, seed=5), replica, 4, lambda probe: policy_profile("extproc", probe, 7, replica, cfg), config=cfg
    )
    sim.run()
    fits = sim.router.latency.view().fits
    assert set(fits) == set(sim.names)
    for fit in fits.values():
        assert fit.ttft_warm and fit.tpot_warm
        assert fit.ttft_error is not None and fit.ttft_error < 0.2
        assert fit.tpot_error is not None and fit.tpot_error < 0.2
