"""One price per candidate: what sending this request there costs, in predicted seconds.

Where the default profile adds scorers in different units (blocks held, tokens pending, requests
decayed over a minute, free KV) and drops replicas at hard thresholds, a price profile weighs
every candidate in one unit, seconds, from the replica's own rates:

- ``prefill_s``: the prompt's tokens the replica does not hold (the prompt less the blocks the
  index, the estimate or its KV events say it holds; a session's pinned replica, while nothing
  says it lost the conversation, at most the turn's new part, ``turn_tokens``) at its prefill rate;
- ``queue_s``: the uncached prefill already sent there and not yet answered, at the same rate
  (the request's first token comes after theirs); both in chunks of ``chunk_tokens`` less the
  running batch, each chunk also waiting one decode step of that batch with its KV read
  (``decode_s_per_kv_token``);
- ``kv_wait_s``: when its cache is full of running requests (the fresher of the scrape's KV usage
  and what the router's requests in flight added), the wait for room: the share of the running
  requests' KV that must be freed, times the time a running request takes to finish its decode.

These three, and the engine's fixed overhead of a request (``overhead_s`` of its rates: HTTP,
template, scheduling, what a cached prompt still takes), are the predicted time to first token of
this request there (:attr:`Price.ttft_s`).
To them the price adds what the choice costs others and later turns:

- ``others_s``: the slowdown of the requests already running there, each stalled by this
  prompt's prefill and slowed per step by one more sequence in the batch, weighed by
  ``others_weight`` (0.05: half the weight the P/D choice gives the same stall,
  :attr:`extproc.routing.disagg.PairSettings.decode_interference`, since a stall of decoding
  streams is not a first token's wait); and the cached prefixes its uncached tokens displace
  there, which later requests recompute (``evict_weight``, 1: the displaced tokens once, at the
  same rate, times how full that cache is believed to be, :class:`CacheFill`), so a copy of a
  prefix elsewhere is not free where the cache is full;
- ``future_s``: for a new conversation (a session key, no pin), the prefill its replica's live
  conversations will queue with their next turns (``session_tokens`` each, the new part of a
  turn), which this conversation's next turns will wait behind;
- ``move_s``: for a session whose pinned replica is a candidate, what leaving it must save before
  it is worth it (``hysteresis`` of staying's price, plus ``hysteresis_s``): staying is already
  cheap where the history is cached (its ``prefill_s`` is the new part of the turn only), and the
  margin keeps a session from flapping between replicas whose prices are about equal; for a
  request without a session, on a replica holding less of its prompt than the best holder,
  ``prefix_hysteresis`` of the holder's price times that replica's cache fill (a prefix copied
  into a full cache splits its later requests and displaces others').

So stickiness is the result of the price, not a scorer with a floor, and spillover happens where
waiting on the pinned replica (its queue, its KV wait) is predicted to cost more than recomputing
the history elsewhere, not at a KV-usage threshold: on a real engine under pressure every
replica's KV is near full with running requests, and a threshold then sends a turn to recompute
its whole history on a replica as full.

Rates: each replica's learned rates where the latency models have them
(:attr:`extproc.routing.latency.LatencyView.rates`, or derived from a warm TTFT/TPOT fit),
else its pool's prior: the first ``health.engine_rates`` entry its labels match
(:attr:`~extproc.routing.latency.LatencyView.priors`, the one place the rate learner reads its
prior too; ``extproc calibrate`` measures it), else the built-in one
(:data:`extproc.engine_rates.BUILT_IN`, the lab's ``llama-8b-h100``: derived from the model's
shape and the GPU's datasheet, not measured). A rate that is unknown or implausible
(non-positive, or off the prior by more than ``learned_within``) is missing evidence and
degrades to the prior; it never counts as free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.engine_rates import BUILT_IN, EngineRates, prior_for
from extproc.request.features import uncached_tokens
from extproc.routing.latency import LatencyFit, LearnedRates
from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState
from extproc.routing.price_parts import Price, Rates

__all__ = [
    "DEFAULT_RATES",
    "PricePicker",
    "PriceScorer",
    "PriceSettings",
    "fit_rates",
    "prices",
]


def _as_rates(engine: EngineRates, source: str) -> Rates:
    return Rates(engine.prefill_tokens_per_s, engine.decode_step_s, engine.decode_per_seq_s, source, engine.overhead_s)


DEFAULT_RATES = _as_rates(BUILT_IN, "prior")
"""The built-in prior: ``llama-8b-h100`` of the lab (:data:`extproc.engine_rates.BUILT_IN`)."""


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


@dataclass(slots=True)
class PriceSettings:
    """What the price is computed with (see the module docstring).

    The rates' prior is not set here: it is each pool's ``health.engine_rates`` entry, read by
    the rate learner too (:meth:`prior`). ``output_tokens`` is a request's expected output when
    it does not say (``max_tokens``).
    """

    output_tokens: int = 256
    others_weight: float = 0.05
    """The weight of the running batch's stall (``others``). At 0.1 a batch of 60 long-output
    streams made a cold 7,000-token prefill cost six times its own time, and prompts queued on
    the replica holding their prefix (shared-prefix TTFT p99 0.644 s against the default
    profile's 0.560 s); at 0.05, 0.582 s; at 0.03 the overloaded shared-prefix row at 12,000
    blocks lost its tail (p99 54 s against 33 s)."""
    session_tokens: int = 512
    turn_tokens: int = 512
    """The new part of a turn: what a session's pinned replica is assumed to lack at most while
    nothing says it lost the conversation (the index may have forgotten it; the replica has not)."""
    evict_weight: float = 1.0
    """The share of what its uncached tokens displace that later requests are expected to
    recompute (added to ``others``, in the prefill's seconds): 1, all of it once. Without it
    (0) the price took the Mooncake trace's requests off the replicas holding their prefix
    for any shorter queue, 24% hit ratio against the default profile's 33%; with 1, 29%."""
    hysteresis: float = 0.25
    prefix_hysteresis: float = 0.5
    """For a request without a session: the share of its price on the replica holding most of its
    prompt that another replica must save before the request copies the prefix there, times that
    replica's :class:`CacheFill` (a copy into a cache with room displaces nothing). Without it the
    price chased shorter queues off the holders of Mooncake's long prefixes (hit ratio 26% against
    the default profile's 33%); with 0.5, 33.8% and TTFT p99 5.42 s against 5.98 s."""
    hysteresis_s: float = 0.01
    decode_s_per_kv_token: float = 6e-8
    """What each token of running context adds to a step (its KV read): ``llama-8b-h100``'s 128 KiB
    a token at ~2.2 TB/s. A step of 60 running requests at 8k tokens of context reads ~30 ms of KV,
    three times its fixed cost, and the prompt's prefill chunks wait through every such step."""
    chunk_tokens: int = 2048
    """The tokens one engine step computes (vLLM's ``--max-num-batched-tokens``): a prompt's prefill
    takes its tokens over this less the running batch, in steps that each pay that batch's decode
    step too. 0: prefill at the rate alone."""
    learned_within: float = 4.0
    """A learned rate more than this factor off its prior is taken for a fit's artefact."""

    def __post_init__(self) -> None:
        if (
            min(
                self.others_weight,
                self.hysteresis,
                self.prefix_hysteresis,
                self.hysteresis_s,
                self.evict_weight,
                self.decode_s_per_kv_token,
            )
            < 0
            or self.output_tokens < 1
        ):
            raise ValueError("weights and margins must not be negative, output_tokens at least 1")
        if min(self.session_tokens, self.turn_tokens) < 0 or self.learned_within < 1:
            raise ValueError("session_tokens and turn_tokens must not be negative, learned_within at least 1")

    def prior(self, cycle: CycleState, state: ReplicaState) -> Rates:
        """The prior rates of ``state``: its pool's (the first ``health.engine_rates`` entry its
        labels match), else the built-in one."""
        priors = cycle.latency.priors if cycle.latency is not None else ()
        return _as_rates(*prior_for(priors, state.replica.labels))

    def _plausible(self, learned: float | None, prior: float) -> bool:
        return (
            learned is not None
            and learned > 0.0
            and prior / self.learned_within <= learned <= prior * self.learned_within
        )

    def rates(self, cycle: CycleState, state: ReplicaState) -> Rates:
        """``state``'s rates: what was learned of it, where plausible, else its prior."""
        prior = self.prior(cycle, state)
        view = cycle.latency
        if view is None:
            return prior
        learned = view.rates.get(state.name)
        if learned is None:
            fit = view.fits.get(state.name)
            if fit is None:
                return prior
            learned = fit_rates(fit)
        prefill = learned.prefill_tokens_per_s
        decode = learned.decode_s_per_token
        per_seq = learned.decode_s_per_seq
        took = False
        overhead = prior.overhead_s
        if self._plausible(prefill, prior.prefill_tokens_per_s):
            took = True
            # The intercept learnt with that slope, where it was (a warm fit's is not an overhead).
            overhead = learned.overhead_s if learned.overhead_s is not None else overhead
        else:
            prefill = prior.prefill_tokens_per_s
        if self._plausible(decode, prior.decode_s_per_token):
            took = True
        else:
            decode = prior.decode_s_per_token
        # A per-sequence cost may well be near zero on a large accelerator: it is only bounded above.
        if per_seq is not None and 0.0 <= per_seq <= max(prior.decode_s_per_seq, 1e-6) * self.learned_within:
            took = True
        else:
            per_seq = prior.decode_s_per_seq
        assert prefill is not None and decode is not None and per_seq is not None
        return Rates(prefill, decode, per_seq, "learned" if took else prior.source, overhead)


class CacheFill:
    """How full each replica's prefix cache is believed to be: the uncached tokens this gateway's
    decisions wrote there, over the cache's size (a cache is full once as many tokens as it holds
    were written into it, and stays full: vLLM frees a block only to reuse it). A replica of
    unknown size counts as full, which prices displacement as before this ledger existed.

    Displacing cached prefixes costs only where the cache is full: on a fleet whose caches still
    have room, a copy of a prefix on another replica evicts nothing (the hot-prefix table's
    caches never fill: there the displaced part cost TTFT p99 0.048 -> 0.078 s for nothing)."""

    __slots__ = ("_written",)

    def __init__(self) -> None:
        self._written: dict[str, float] = {}

    def fill(self, state: ReplicaState) -> float:
        """The share of ``state``'s cache believed full, in [0, 1]."""
        capacity = state.kv_capacity_tokens
        if capacity <= 0:
            return 1.0
        return min(1.0, self._written.get(state.name, 0.0) / capacity)

    def wrote(self, replica: str, tokens: int) -> None:
        """A decision sent ``tokens`` uncached tokens to ``replica``."""
        self._written[replica] = self._written.get(replica, 0.0) + max(0, tokens)

    def forget(self, replica: str) -> None:
        """``replica``'s cache was reset (or the replica replaced): nothing written there holds."""
        self._written.pop(replica, None)


def _batch(state: ReplicaState) -> int:
    """Requests running or waiting there: the router's count in flight, or the scrape's if more."""
    return max(state.inflight, state.running + state.queue)


def _price(
    cycle: CycleState,
    state: ReplicaState,
    settings: PriceSettings,
    block_chars: int,
    new_conversation: bool,
    fill: CacheFill | None,
) -> Price:
    features = cycle.features
    rates = settings.rates(cycle, state)
    rate = rates.prefill_tokens_per_s
    view = cycle.view
    uncached = uncached_tokens(features, view.prefix_matches.get(state.name, 0), block_chars)
    if state.name == view.pinned and view.pin_lost is None:
        # The pin's conversation is there until the replica itself says it is gone: an index that
        # forgot it is no evidence (``AffinityView.pin_lost``), so it lacks at most the turn's new part.
        uncached = min(uncached, settings.turn_tokens)
    batch = _batch(state)
    queued = max(0, state.pending_prefill_tokens)
    # A busy replica prefills in chunks beside its running batch's decode: every chunk's step also
    # pays that batch's decode step, so a prompt's first token comes later where more decode.
    capacity = state.kv_capacity_tokens
    # KV referenced by running requests: the fresher of the scrape and what we sent since. Every
    # step reads it (attention over the running requests' context), prefill steps too.
    used = max(float(state.inflight_tokens), min(1.0, max(0.0, state.kv_usage)) * capacity)
    step = rates.decode_step_s(batch + 1) + settings.decode_s_per_kv_token * used
    prefill = uncached / rate
    queue = queued / rate
    if settings.chunk_tokens:
        chunk = max(1, settings.chunk_tokens - batch)
        own_steps = max(1, math.ceil(uncached / chunk))
        prefill += own_steps * step
        queue += (max(1, math.ceil((queued + uncached) / chunk)) - own_steps) * step
    output_tokens = features.expected_output_tokens or settings.output_tokens  # an agent's osl, else the cap
    kv_wait = 0.0
    if capacity > 0:
        short = used + uncached - capacity
        if short > 0.0 and used > 0.0:
            # Running requests free their KV as they finish, about evenly over one request's decode.
            kv_wait = min(1.0, short / used) * output_tokens * step
    others = settings.others_weight * batch * (uncached / rate + output_tokens * rates.decode_s_per_seq)
    # The blocks it adds there displace cached prefixes (a cache is full of them once warm),
    # some of which later requests would have hit: a copy of a prefix elsewhere costs its
    # recompute now and the locality it takes from the prefix's next requests.
    others += settings.evict_weight * uncached / rate * (fill.fill(state) if fill is not None else 1.0)
    future = 0.0
    if new_conversation and settings.session_tokens:
        future = state.live_sessions * settings.session_tokens / rate
    return Price(prefill, queue, kv_wait, others, future, 0.0, uncached, rates)


def prices(
    cycle: CycleState,
    candidates: Sequence[ReplicaState],
    settings: PriceSettings,
    block_chars: int,
    fill: CacheFill | None = None,
) -> dict[str, Price]:
    """Each candidate's price for this request, computed once per decision (kept on the cycle
    state). A session's pinned replica, if a candidate, is priced as it is; every other candidate
    is charged the move (``hysteresis`` of the pinned replica's price plus ``hysteresis_s``)."""
    if cycle.prices is not None:
        return cycle.prices
    pinned = cycle.view.pinned
    new_conversation = bool(cycle.features.session_key) and pinned is None
    out = {c.name: _price(cycle, c, settings, block_chars, new_conversation, fill) for c in candidates}
    stay = out.get(pinned) if pinned is not None else None
    if stay is not None:
        margin = settings.hysteresis * stay.total_s + settings.hysteresis_s
        for name, p in out.items():
            if name != pinned:
                out[name] = Price(
                    p.prefill_s, p.queue_s, p.kv_wait_s, p.others_s, p.future_s, margin, p.uncached_tokens, p.rates
                )
    elif settings.prefix_hysteresis and out:
        # No session: the replica holding most of the prompt is where its prefix lives. A copy
        # elsewhere splits the prefix's later requests and, in a full cache, displaces others':
        # a request leaves the holder only for a clear saving, and only where the copy displaces.
        holder = min(out, key=lambda n: (out[n].uncached_tokens, out[n].total_s))
        stay = out[holder]
        margin = settings.prefix_hysteresis * stay.total_s + settings.hysteresis_s
        by_name = {c.name: c for c in candidates}
        for name, p in out.items():
            if p.uncached_tokens > stay.uncached_tokens:
                m = margin * (fill.fill(by_name[name]) if fill is not None else 1.0)
                out[name] = Price(
                    p.prefill_s, p.queue_s, p.kv_wait_s, p.others_s, p.future_s, m, p.uncached_tokens, p.rates
                )
    cycle.prices = out
    return out


def predicted_ttft_s(cycle: CycleState, state: ReplicaState, settings: PriceSettings) -> float:
    """The price's time to first token of the request on ``state`` (:attr:`Price.ttft_s`): its
    parts depend on that candidate alone, so it is the same whatever else is a candidate."""
    return _price(cycle, state, settings, cycle.block_chars, False, None).ttft_s


def prefill_here_s(cycle: CycleState, state: ReplicaState, settings: PriceSettings, fill: CacheFill | None) -> float:
    """What prefilling the request on ``state`` costs: its time to first token there and what it
    costs the requests already there (``others``: the stall of the batch it decodes)."""
    p = _price(cycle, state, settings, cycle.block_chars, False, fill)
    return p.ttft_s + p.others_s


@dataclass(slots=True)
class PricePicker(PriceSettings):
    """Orders the candidates by their price, cheapest first (:func:`prices`). The profile's
    scorers only break what the price leaves about tied: each point of their weighted total is
    worth ``seconds_per_point`` off the price (the ring, at weight 0.1, keeps gateways without
    shared state in agreement on an idle fleet); then the name, for a deterministic order."""

    seconds_per_point: float = 0.001
    name: str = "price"
    fill: CacheFill = field(default_factory=CacheFill, init=False, repr=False, compare=False)
    """What this picker's choices wrote into each replica's cache (:class:`CacheFill`)."""

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates, cheapest first; the first is taken to be where the request goes."""
        priced = prices(cycle, candidates, self, cycle.block_chars, self.fill)
        per_point = self.seconds_per_point
        ordered = sorted(
            candidates, key=lambda c: (priced[c.name].total_s - per_point * totals.get(c.name, 0.0), c.name)
        )
        if ordered:
            self.fill.wrote(ordered[0].name, priced[ordered[0].name].uncached_tokens)
        return ordered

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet: a replica of that name later starts with an empty cache."""
        self.fill.forget(replica)


@dataclass(slots=True)
class PriceScorer(PriceSettings):
    """The price as a score in [0, 1], for a profile that weighs it beside other scorers: 1 for
    the cheapest candidate, falling linearly with the extra seconds over the dearest's price
    (never over less than ``floor_s``, so near-equal prices score alike)."""

    floor_s: float = 0.05
    name: str = "price"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Score each candidate's price."""
        if not candidates:
            return {}
        priced = prices(cycle, candidates, self, cycle.block_chars)
        totals = {c.name: priced[c.name].total_s for c in candidates}
        lo = min(totals.values())
        scale = max(max(totals.values()) - lo, self.floor_s, 1e-9)
        return {name: max(0.0, min(1.0, 1.0 - (t - lo) / scale)) for name, t in totals.items()}
