"""What a price is made of: a candidate's price in seconds, in its parts (:class:`Price`), and the
rates it was computed at (:class:`Rates`). Computed by :mod:`extproc.routing.price`; here, below the
pipeline's plugins, because a decision's :class:`~extproc.routing.plugins.CycleState` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.base.engine_rates import BUILT_IN_SOURCE


@dataclass(frozen=True, slots=True)
class Rates:
    """How fast a replica computes: prompt tokens a second (cold), the decode step of a batch of
    one, and what each further sequence adds to a step; ``source`` says where they came from
    (``prior``, ``pool:<selector>``, ``learned``); ``overhead_s``, the seconds of a time to first
    token no prompt token explains."""

    prefill_tokens_per_s: float
    decode_s_per_token: float
    decode_s_per_seq: float
    source: str = BUILT_IN_SOURCE
    overhead_s: float = 0.0

    def decode_step_s(self, batch: float) -> float:
        """Seconds of one decode step with ``batch`` sequences (at least one)."""
        return self.decode_s_per_token + self.decode_s_per_seq * max(0.0, batch - 1.0)


@dataclass(frozen=True, slots=True)
class Price:
    """One candidate's price for one request, in seconds, and its parts (:mod:`extproc.routing.price`
    says what each is)."""

    prefill_s: float
    queue_s: float
    kv_wait_s: float
    others_s: float
    future_s: float
    move_s: float
    uncached_tokens: int
    rates: Rates
    adapter_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        """The predicted time to first token there: the engine's overhead, loading the request's
        LoRA adapter, its prefill, the queue before it, the KV wait."""
        return self.rates.overhead_s + self.adapter_s + self.prefill_s + self.queue_s + self.kv_wait_s

    @property
    def total_s(self) -> float:
        """The whole price: the time to first token and what the choice costs others and later turns."""
        return self.ttft_s + self.others_s + self.future_s + self.move_s

    def parts(self) -> dict[str, float]:
        """The parts by name (Explain)."""
        return {
            "overhead": self.rates.overhead_s,
            "adapter": self.adapter_s,
            "prefill": self.prefill_s,
            "queue": self.queue_s,
            "kv_wait": self.kv_wait_s,
            "others": self.others_s,
            "future": self.future_s,
            "move": self.move_s,
        }
