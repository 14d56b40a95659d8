"""How fast a replica computes, as the price (:mod:`extproc.routing.price`) reads it.

Rates: each replica's learned rates where the latency models have them
(:attr:`extproc.routing.latency.LatencyView.rates`, or derived from a warm TTFT/TPOT fit),
else its pool's prior: the first ``health.engine_rates`` entry its labels match
(:attr:`~extproc.routing.latency.LatencyView.priors`, the one place the rate learner reads its
prior too; ``extproc calibrate`` measures it), else the built-in one
(:data:`extproc.base.engine_rates.BUILT_IN`, the lab's ``llama-8b-h100``: derived from the model's
shape and the GPU's datasheet, not measured). A rate that is unknown or implausible
(non-positive, or off the prior by more than ``learned_within``) is missing evidence and
degrades to the prior; it never counts as free.
"""

from __future__ import annotations

from extproc.base.engine_rates import BUILT_IN, BUILT_IN_SOURCE, EngineRates
from extproc.routing.latency import LatencyFit, LearnedRates
from extproc.routing.price_parts import Rates


def as_rates(engine: EngineRates, source: str) -> Rates:
    """An engine's rates (a prior of ``health.engine_rates`` or the built-in one) as the price reads them."""
    return Rates(engine.prefill_tokens_per_s, engine.decode_step_s, engine.decode_per_seq_s, source, engine.overhead_s)


DEFAULT_RATES = as_rates(BUILT_IN, BUILT_IN_SOURCE)
"""The built-in prior: ``llama-8b-h100`` of the lab (:data:`extproc.base.engine_rates.BUILT_IN`)."""


def fit_rates(fit: LatencyFit) -> LearnedRates:
    """The rates a warm latency fit implies: its TTFT's seconds per thousand uncached tokens
    (the prefill rate's inverse), its TPOT's constant (a step of one) and batch term (per sixteen
    sequences). Terms that are not positive say nothing of a rate (the fit's terms are collinear
    on a quiet replica) and are left unknown."""
    prefill = decode = per_seq = None
    if fit.ttft_warm and len(fit.ttft) > 1 and fit.ttft[1] > 0.0:
        prefill = 1000.0 / fit.ttft[1]
    if fit.tpot_warm and len(fit.tpot) > 1:
        if fit.tpot[0] > 0.0:
            decode = fit.tpot[0]
        if fit.tpot[1] > 0.0:
            per_seq = fit.tpot[1] / 16.0
    return LearnedRates(prefill, decode, per_seq)
