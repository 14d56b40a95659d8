"""An engine's speeds as the router prices a choice with them: one small typed value per replica.

:class:`EngineRates` is what :mod:`extproc.health.rates` learns online from the timings the router
observes (:mod:`extproc.token_clock`), starting from a prior the user sets per replica pool
(``health.engine_rates``). It lives at the bottom layer so that the pure decision code
(``extproc.routing``) can take it as an input without importing the health package.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def prefill_s(self, uncached_tokens: float) -> float:
        """Seconds to prefill ``uncached_tokens`` alone, its overhead included."""
        return self.overhead_s + max(0.0, uncached_tokens) / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: float) -> float:
        """Seconds to decode ``output_tokens`` after the first, alone."""
        return max(0.0, output_tokens - 1.0) * self.decode_step_s
