"""Each replica's latency model, learned online from what the router observes.

For every answered request the router knows the :class:`~extproc.routing.latency.LoadPoint` it
was sent at (its uncached prompt, the prefill queued there, the batch, KV usage) and, from the
response, its time to first byte; at its end, the time per output token after the first. Two
linear models per replica (TTFT and TPOT over the point's terms) are fitted by recursive least
squares, weighted by the inverse square of the model's own prediction so that errors count
relative to the latency (a 20 ms prediction 20 ms off is as wrong as a 2 s one 2 s off) while the
fit stays on the mean: the quasi-likelihood of noise proportional to the latency, fitted as
iteratively reweighted least squares. (Weighing by the observed value instead gives the fastest
outliers the most say, and the fit settles below the mean: under noisy overload it predicted a
third of the TPOT that came, so every objective looked met.)

Learned only where wanted (``health.latency_models``): by default from the first request that
carries an objective on (:meth:`LatencyBook.wanted`), so a fleet that never states one does not pay
for fitting. Cheap and bounded: an update is a few hundred float operations on a 7x7 matrix, done when a
response is observed, never while deciding; the decision reads the fits as they were last
updated (:meth:`LatencyBook.view`). Before ``warm_after`` observations a model starts from a
prior (an engine prefilling 10k tokens/s with 20 ms steps) and is not used. Old observations are
forgotten (``forget`` 0.99: about the last hundred weigh; the fleet's load and the replica's speed
drift, and a load ramp changes what a batch costs within seconds), without letting the
uncertainty of a term that never varies blow up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from statistics import median

from extproc.base.engine_rates import PoolRates
from extproc.routing.latency import LatencyFit, LatencyView, LoadPoint

TTFT_PRIOR = (0.02, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0)
"""Seconds: 20 ms, plus 100 ms per thousand tokens of prefill (this prompt's or the queue's)."""
TPOT_PRIOR = (0.02, 0.005, 0.01, 0.0)
"""Seconds per token: 20 ms, a little more with the batch and the context."""
PRIOR_VARIANCE = 1.0
FLOOR_S = 0.002
"""Observations below this weigh as if they were this (a relative error of a near-zero value
would be infinite)."""


class _RecursiveFit:
    """Weighted recursive least squares with forgetting over a fixed number of terms."""

    __slots__ = ("_p", "cap", "forget", "theta")

    def __init__(self, prior: Sequence[float], variance: float, forget: float) -> None:
        n = len(prior)
        self.theta = list(prior)
        self._p = [[variance if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forget = forget
        self.cap = variance  # no term's uncertainty grows past the prior's by forgetting

    def predict(self, x: Sequence[float]) -> float:
        return sum(a * v for a, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], y: float, weight: float) -> None:
        p = self._p
        n = len(x)
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = 1.0 / weight + sum(x[i] * px[i] for i in range(n))
        if denom <= 0.0:
            return
        err = y - self.predict(x)
        gain = [v / denom for v in px]
        for i in range(n):
            self.theta[i] += gain[i] * err
        # Forget only while no term is more uncertain than the prior: a term that never varies
        # (KV usage of a replica that is never full) would otherwise grow without bound.
        scale = 1.0 / self.forget if max(p[i][i] for i in range(n)) < self.cap else 1.0
        for i in range(n):
            row, gi = p[i], gain[i]
            for j in range(n):
                row[j] = (row[j] - gi * px[j]) * scale


class _Model:
    """One latency (TTFT or TPOT) of one replica: the fit, its count, its recent errors."""

    __slots__ = ("errors", "fit", "samples")

    def __init__(self, prior: Sequence[float], forget: float, window: int) -> None:
        self.fit = _RecursiveFit(prior, PRIOR_VARIANCE, forget)
        self.samples = 0
        self.errors: deque[float] = deque(maxlen=window)

    def observe(self, terms: Sequence[float], seconds: float, warm_after: int) -> None:
        scale = seconds
        if self.samples >= warm_after:
            predicted = max(self.fit.predict(terms), 0.0)
            self.errors.append(abs(predicted - seconds) / max(seconds, FLOOR_S))
            # Weighed by the prediction, not the observation (the module docstring says why);
            # until warm the prior's prediction means nothing, so the observation stands in.
            scale = predicted
        floor = max(scale, FLOOR_S)
        self.fit.update(terms, seconds, 1.0 / (floor * floor))
        self.samples += 1

    def error(self) -> float | None:
        return median(self.errors) if self.errors else None

    def quantiles(self, qs: Sequence[float]) -> tuple[float, ...] | None:
        if not self.errors:
            return None
        ordered = sorted(self.errors)
        last = len(ordered) - 1
        return tuple(ordered[min(last, max(0, round(q * last)))] for q in qs)


class _Replica:
    __slots__ = ("tpot", "ttft")

    def __init__(self, forget: float, window: int) -> None:
        self.ttft = _Model(TTFT_PRIOR, forget, window)
        self.tpot = _Model(TPOT_PRIOR, forget, window)


class LatencyBook:
    """Every replica's latency models; :meth:`view` is what the decision reads."""

    def __init__(
        self,
        block_tokens: int = 16,
        *,
        warm_after: int = 32,
        forget: float = 0.99,
        error_window: int = 128,
        learning: bool = True,
        priors: Sequence[PoolRates] = (),
    ) -> None:
        self.learning = learning
        """Whether responses are observed at all (see :meth:`wanted`)."""
        self.warm_after = warm_after
        self.forget = forget
        self.error_window = error_window
        self._replicas: dict[str, _Replica] = {}
        self._fits: dict[str, LatencyFit] = {}
        self._view = LatencyView(self._fits, block_tokens, priors=tuple(priors))

    def wanted(self) -> None:
        """A request stated an objective: learn from now on (models warm after ``warm_after``
        responses a replica; until then the decision is what it would be without objectives)."""
        self.learning = True

    def view(self) -> LatencyView:
        """The fits as last updated (the same object between updates; the decision only reads it)."""
        return self._view

    def observe_ttft(self, name: str, point: LoadPoint, seconds: float) -> None:
        """Replica ``name`` answered a request sent at ``point`` after ``seconds``."""
        if seconds >= 0.0:
            rec = self._replica(name)
            rec.ttft.observe(point.ttft_terms(), seconds, self.warm_after)
            self._refit(name, rec)

    def observe_tpot(self, name: str, point: LoadPoint, seconds_per_token: float) -> None:
        """A request sent to ``name`` at ``point`` streamed its tokens ``seconds_per_token`` apart."""
        if seconds_per_token >= 0.0:
            rec = self._replica(name)
            rec.tpot.observe(point.tpot_terms(), seconds_per_token, self.warm_after)
            self._refit(name, rec)

    def error_quantiles(self, name: str, qs: Sequence[float] = (0.5, 0.9)) -> dict[str, tuple[float, ...]]:
        """The quantiles ``qs`` of replica ``name``'s recent absolute relative errors, per latency
        (``ttft``, ``tpot``) that has any: sorted from the window when asked (at a scrape), never
        per request."""
        rec = self._replicas.get(name)
        out: dict[str, tuple[float, ...]] = {}
        if rec is not None:
            for latency, model in (("ttft", rec.ttft), ("tpot", rec.tpot)):
                values = model.quantiles(qs)
                if values is not None:
                    out[latency] = values
        return out

    def _replica(self, name: str) -> _Replica:
        rec = self._replicas.get(name)
        if rec is None:
            rec = self._replicas[name] = _Replica(self.forget, self.error_window)
        return rec

    def _refit(self, name: str, rec: _Replica) -> None:
        self._fits[name] = LatencyFit(
            ttft=tuple(rec.ttft.fit.theta),
            tpot=tuple(rec.tpot.fit.theta),
            ttft_samples=rec.ttft.samples,
            tpot_samples=rec.tpot.samples,
            ttft_error=rec.ttft.error(),
            tpot_error=rec.tpot.error(),
            ttft_warm=rec.ttft.samples >= self.warm_after,
            tpot_warm=rec.tpot.samples >= self.warm_after,
        )
