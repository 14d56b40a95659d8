"""Each replica's engine speeds, learned online from what the router observes of its answers.

A timed answer (:mod:`extproc.request.token_clock`) gives a time to first token and, for a stream, a time
per output token. Those of requests sent to a replica with nothing else in flight there (no
request running or waiting, no prefill queued) measure its engine alone:

- **prefill** (cold): the time to first token against the prompt tokens not believed cached
  there, fitted as a line (intercept: the request's fixed overhead; slope: the inverse of the
  prefill throughput) by exponentially forgetting least squares; until the prompts seen vary
  enough to give a slope, or it comes out non-positive, the prior's throughput stands;
- **decode**: the time per output token, an exponentially weighted mean.

Each starts from the prior of the first ``health.engine_rates`` entry whose labels the replica
carries (its pool; :func:`extproc.base.engine_rates.prior_for`, as the price reads it), which weighs
as ``prior_weight`` observations. Observations under load are not
used here: what load adds is the latency models' part (:mod:`extproc.fleet.health.latency`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.base.engine_rates import EngineRates, PoolRates, prior_for
from extproc.routing.latency import LearnedRates, LoadPoint

FORGET = 0.98
"""Each observation weighs this much less after the next: about the last fifty count."""
MIN_SPREAD_TOKENS = 64.0
"""The prompts seen must spread over this many tokens (standard deviation) before a slope is
believed: a line through points at one length is any line."""


@dataclass(slots=True)
class _Prefill:
    """Weighted sums of (uncached tokens, seconds) for the line's fit."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    n: int = 0

    def add(self, x: float, y: float) -> None:
        f = FORGET
        self.w, self.x, self.y = self.w * f + 1.0, self.x * f + x, self.y * f + y
        self.xx, self.xy = self.xx * f + x * x, self.xy * f + x * y
        self.n += 1


@dataclass(slots=True)
class _Replica:
    prior: EngineRates
    prefill: _Prefill
    decode_sum: float = 0.0
    decode_weight: float = 0.0
    decode_n: int = 0


class RateBook:
    """Every replica's :class:`~extproc.base.engine_rates.EngineRates`; :meth:`view` is what pricing reads."""

    def __init__(self, priors: Sequence[PoolRates] = (), *, prior_weight: float = 4.0) -> None:
        self.priors = tuple(priors)
        self.prior_weight = prior_weight
        self._replicas: dict[str, _Replica] = {}
        self._rates: dict[str, EngineRates] = {}

    def prior_for(self, labels: Mapping[str, str]) -> EngineRates:
        """The first prior whose labels ``labels`` all carry (the built-in one if none)."""
        return prior_for(self.priors, labels)[0]

    def view(self) -> Mapping[str, EngineRates]:
        """Each replica's rates as last updated (replicas never observed are absent: see :meth:`rates`)."""
        return self._rates

    def learned(self) -> dict[str, LearnedRates]:
        """What the price takes from the engine rates: only what was learnt (a prior stays the
        price's own, so a replica nothing was observed of is priced as its pool is). Per decision:
        only the replicas observed are read (none until answers are timed), no prior is made."""
        out = {}
        for name, r in self.view().items():
            prefill = r.prefill_tokens_per_s if r.prefill_samples > 0 else None
            overhead = r.overhead_s if r.prefill_samples > 0 else None
            decode = r.decode_step_s if r.decode_samples > 0 else None
            if prefill is not None or decode is not None:
                out[name] = LearnedRates(prefill_tokens_per_s=prefill, decode_s_per_token=decode, overhead_s=overhead)
        return out

    def rates(self, name: str, labels: Mapping[str, str]) -> EngineRates:
        """Replica ``name``'s rates: learned where observed, else its pool's prior."""
        known = self._rates.get(name)
        if known is not None:
            return known
        return self.prior_for(labels)

    def observe_ttft(self, name: str, labels: Mapping[str, str], point: LoadPoint, seconds: float) -> None:
        """A request sent at ``point`` had its first token after ``seconds``: learnt from if it was alone."""
        if point.running > 0 or point.queued_prefill_tokens > 0 or seconds <= 0.0:
            return
        rec = self._replica(name, labels)
        rec.prefill.add(point.uncached_tokens, seconds)
        self._update(name, rec)

    def observe_tpot(self, name: str, labels: Mapping[str, str], point: LoadPoint, seconds_per_token: float) -> None:
        """A stream sent at ``point`` decoded ``seconds_per_token`` a token: learnt from if it was alone."""
        if point.running > 0 or point.queued_prefill_tokens > 0 or seconds_per_token <= 0.0:
            return
        rec = self._replica(name, labels)
        rec.decode_sum = rec.decode_sum * FORGET + seconds_per_token
        rec.decode_weight = rec.decode_weight * FORGET + 1.0
        rec.decode_n += 1
        self._update(name, rec)

    def _replica(self, name: str, labels: Mapping[str, str]) -> _Replica:
        rec = self._replicas.get(name)
        if rec is None:
            rec = self._replicas[name] = _Replica(self.prior_for(labels), _Prefill())
        return rec

    def _update(self, name: str, rec: _Replica) -> None:
        prior, p, k = rec.prior, rec.prefill, self.prior_weight
        per_token, overhead = 1.0 / prior.prefill_tokens_per_s, prior.overhead_s
        if p.w > 0.0:
            mx, my = p.x / p.w, p.y / p.w
            var = p.xx / p.w - mx * mx
            if var >= MIN_SPREAD_TOKENS * MIN_SPREAD_TOKENS:
                slope = (p.xy / p.w - mx * my) / var
                if slope > 0.0:  # the prior's slope weighs as k observations
                    per_token = (slope * p.w + per_token * k) / (p.w + k)
            overhead = max(0.0, (my - per_token * mx) * p.w / (p.w + k) + overhead * k / (p.w + k))
        step = (rec.decode_sum + prior.decode_step_s * k) / (rec.decode_weight + k)
        self._rates[name] = EngineRates(1.0 / per_token, step, overhead, p.n, rec.decode_n, prior.decode_per_seq_s)
