"""Config ``health:``: scraping, the score and the rotation state machine."""

from __future__ import annotations

from typing import Literal

from extproc.base.engine_rates import BUILT_IN, EngineRates, PoolRates
from extproc.base.validation import Section, option
from extproc.fleet.health.rotation import RotationPolicy
from extproc.fleet.health.score import HealthLimits, HealthWeights


class RatePrior(Section):
    """``health.engine_rates[]``: a pool's engine speeds before any is learnt, read by the rate
    learner and the price alike (``extproc calibrate`` measures them on a running engine). The
    built-in one, for replicas no entry selects: the lab's ``llama-8b-h100`` profile, derived from
    the model's shape and the GPU's datasheet (:data:`extproc.base.engine_rates.BUILT_IN`)."""

    labels: dict[str, str] = option({}, "the replicas it is for: those carrying every label ({}: all)")
    prefill_tokens_per_s: float = option(
        BUILT_IN.prefill_tokens_per_s, "cold prefill throughput, one request alone", gt=0
    )
    decode_step_s: float = option(
        BUILT_IN.decode_step_s, "seconds between two tokens of one request decoding alone", gt=0
    )
    decode_per_seq_s: float = option(
        BUILT_IN.decode_per_seq_s, "seconds each further sequence in the batch adds to a decode step", ge=0
    )
    overhead_s: float = option(BUILT_IN.overhead_s, "seconds of a time to first token no prompt token explains", ge=0)

    def pool(self) -> PoolRates:
        """This prior as the decision code takes it."""
        rates = EngineRates(
            self.prefill_tokens_per_s, self.decode_step_s, self.overhead_s, decode_per_seq_s=self.decode_per_seq_s
        )
        return PoolRates(dict(self.labels), rates)


class HealthSettings(RotationPolicy):
    """``health:``: scraping vLLM's /metrics, the health score and the rotation (its thresholds
    are this section's own keys: the section is the rotation's policy)."""

    scrape_interval_s: float = option(0.25, "how often each replica's /metrics is read", ge=0.01)
    scrape_timeout_s: float = option(0.2, "a scrape slower than this failed", ge=0.001)
    stale_after_s: float = option(2.0, "load figures older than this are ignored", ge=0.01)
    metrics_path: str = option("/metrics", "the replicas' metrics path")
    upstream_fail_after: int = option(3, "502/503/504 or no answer in a row seen by Envoy: ejected at once", ge=1)
    ttft_window_s: float = option(60.0, "window of the TTFT p99", ge=1)
    recent_half_life_s: float = option(
        60.0, "half-life of the decayed count of requests recently sent to a replica", gt=0
    )
    # Below 1.0 the other requests skip the response-headers ext_proc message: fewer round trips,
    # a cheaper processor (docs/performance.md), less passive health.
    response_sample_rate: float = option(1.0, "share of requests whose response headers are observed", ge=0, le=1)
    # Fitting a model costs ~20 us a response in pure Python (benchmarks/overhead.md): not paid
    # by fleets that never state an objective.
    latency_models: Literal["auto", "always", "off"] = option(
        "auto",
        "learn each replica's TTFT/TPOT from responses: auto = once a request carries an objective "
        "(x-slo-ttft-ms, x-slo-tpot-ms), always = from the start, off = never (objectives are then ignored)",
    )
    # Reading a timed answer's body costs the processor ~115 us of CPU a streamed token through
    # gRPC (benchmarks/token_timing.md): auto pays it only where what it gives is used, and
    # token_timing_rate only for that share of those answers.
    token_timing: Literal["auto", "always", "off"] = option(
        "auto",
        "read sampled answers' bodies for when their tokens came (TTFT, TPOT, the end of prefill; docs/routing.md): "
        "auto = where the latency models learn or split arms are compared, always = every sampled answer, off = never",
    )
    token_timing_rate: float = option(
        1.0,
        "share of the answers token_timing would time that are (the rest: their headers end their prefill)",
        ge=0,
        le=1,
    )
    engine_rates: list[RatePrior] = option(
        [],
        "each pool's prior engine speeds, learnt on from its answers and read by the price (docs/routing.md; "
        "extproc calibrate measures them); the first whose labels match",
    )
    weights: HealthWeights = option(HealthWeights(), "how much each signal counts")
    limits: HealthLimits = option(HealthLimits(), "where each penalty starts and is full")

    @property
    def rotation(self) -> RotationPolicy:
        """The rotation's thresholds: this section's own."""
        return self
