"""An engine's speeds as the router prices a choice with them: one small typed value per replica.

:class:`EngineRates` is what :mod:`extproc.fleet.health.rates` learns online from the timings the router
observes (:mod:`extproc.request.token_clock`), starting from a prior the user sets per replica pool
(``health.engine_rates``, :class:`PoolRates` here), which ``extproc calibrate`` measures on a
running engine. The price (:mod:`extproc.routing.price`) reads the same priors: one place for a
pool's speeds. It lives at the bottom layer so that the pure decision code (``extproc.routing``)
can take it as an input without importing the health package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineRates:
    """One replica's engine speeds: its cold prefill throughput and its decode step."""

    prefill_tokens_per_s: float
    """Uncached prompt tokens a second, for one request prefilled alone (the slope of its time to
    first token over its uncached tokens on an idle replica)."""
    decode_step_s: float
    """Seconds between two tokens of one request decoding alone (its time per output token)."""
    overhead_s: float = 0.0
    """Seconds of a request's time to first token that no prompt token explains (the intercept)."""
    prefill_samples: int = 0
    """Observations behind the prefill rate (0: it is the prior)."""
    decode_samples: int = 0
    """Observations behind the decode step (0: it is the prior)."""
    decode_per_seq_s: float = 0.0
    """Seconds each further sequence in the batch adds to a decode step (a prior: not learnt here)."""

    def prefill_s(self, uncached_tokens: float) -> float:
        """Seconds to prefill ``uncached_tokens`` alone, its overhead included."""
        return self.overhead_s + max(0.0, uncached_tokens) / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: float) -> float:
        """Seconds to decode ``output_tokens`` after the first, alone."""
        return max(0.0, output_tokens - 1.0) * self.decode_step_s


BUILT_IN = EngineRates(20_000.0, 0.010, 0.008, decode_per_seq_s=5e-5)
"""The prior of a replica no ``health.engine_rates`` entry selects: the lab's ``llama-8b-h100``
profile (``extproc_lab.replica.timing.LLAMA_8B_H100``: Llama-3.1-8B in bf16 on one H100 SXM,
derived from the model's shape and the GPU's datasheet, 16 GFLOP a token at a third of 989
TFLOP/s = 20,000 prefill tokens/s, a 10 ms decode step, 0.05 ms per further sequence, 8 ms of
fixed overhead). No vLLM, llm-d or Dynamo publication at hand gives these per-GPU rates: it is a
derivation, not a measurement, and any other fleet should state its own (``extproc calibrate``)."""


BUILT_IN_SOURCE = "prior"
"""The ``source`` of rates that are the built-in prior's: nothing measured of the replica."""


@dataclass(frozen=True, slots=True)
class PoolRates:
    """A pool's prior: the replicas carrying every one of ``labels`` (``{}``: all) start from ``rates``."""

    labels: Mapping[str, str] = field(default_factory=dict)
    rates: EngineRates = BUILT_IN

    @property
    def source(self) -> str:
        """Where a rate from this prior came from, as Explain shows it (``pool:K=V,...``; ``pool:*``)."""
        return "pool:" + (",".join(f"{k}={v}" for k, v in sorted(self.labels.items())) or "*")


def prior_for(priors: Sequence[PoolRates], labels: Mapping[str, str]) -> tuple[EngineRates, str]:
    """The rates of the first prior whose labels ``labels`` all carry, and its source; the built-in
    one (source ``prior``) if none does."""
    for prior in priors:
        if all(labels.get(k) == v for k, v in prior.labels.items()):
            return prior.rates, prior.source
    return BUILT_IN, BUILT_IN_SOURCE
