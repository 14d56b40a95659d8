"""One price per candidate: what sending this request there costs, in predicted seconds.

Where the scores profile adds scorers in different units (blocks held, tokens pending, requests
decayed over a minute, free KV) and drops replicas at hard thresholds, the price profile
weighs every candidate in one unit, seconds, from the replica's own rates:

- ``prefill_s``: the prompt's tokens the replica does not hold (the prompt less the blocks the
  index, the estimate or its KV events say it holds; a session's pinned replica, while nothing
  says it lost the conversation, at most the turn's new part, ``turn_tokens``) at its prefill rate;
- ``queue_s``: the uncached prefill already sent there and not yet answered, at the same rate
  (the request's first token comes after theirs), or, where the engine reports more requests
  waiting than that covers, ``waiting_tokens`` for each; both in chunks of ``chunk_tokens`` less the
  running batch, each chunk also waiting one decode step of that batch with its KV read
  (``decode_s_per_kv_token``);
- ``adapter_s``: for a LoRA adapter the replica does not hold in a slot, loading it
  (``adapter_load_s``);
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
  same rate, times how full that cache is believed to be, :attr:`ReplicaState.cache_fill`: a
  copy of a prefix elsewhere is not free where the cache is full, and displaces nothing where it
  has room: the hot-prefix table's caches never fill, and there the displaced part, counted as if
  they did, cost TTFT p99 0.048 -> 0.078 s for nothing);
- ``future_s``: for a new conversation (a session key, no pin; not a keyless request whose history
  continues a conversation the router does not remember), the prefill its replica's live
  conversations will queue with their next turns (``session_tokens`` each, the new part of a
  turn), which this conversation's next turns will wait behind; a keyless opening counts at the
  rate such openings come back (:attr:`~extproc.routing.model.ReplicaState.live_sessions`):
  counted in full, a hot prefix's single questions, which never come back, priced its holder out
  (simulator hot-prefix TTFT p99 0.131 s against 0.038 s); and, with ``working_set_weight`` (off
  by default), for any request with a session, what its place makes its own next turns and its
  neighbours' recompute where their histories no longer fit that cache together
  (:func:`~extproc.routing.model.working_set_overflow`);
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

The rates a price uses are :mod:`extproc.routing.rates`' (each replica's learned rates, else its
pool's prior), chosen by :class:`~extproc.routing.price_settings.PriceSettings`, which holds the
price's weights and margins too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from extproc.base.engine_rates import BUILT_IN_SOURCE
from extproc.request.features import RequestFeatures, uncached_tokens
from extproc.routing.lora import adapter_requested
from extproc.routing.model import ReplicaState, working_set_overflow
from extproc.routing.plugins import CycleState
from extproc.routing.price_parts import Price
from extproc.routing.price_settings import PriceSettings

__all__ = [
    "Price",
    "PricePicker",
    "PriceScorer",
    "prices",
]


def _batch(state: ReplicaState) -> int:
    """Requests running or waiting there: the router's count in flight, or the scrape's if more."""
    return max(state.inflight, state.running + state.queue)


def _held_blocks(cycle: CycleState, state: ReplicaState) -> int:
    """The request's leading blocks ``state`` is believed to hold. A hot prefix's k replicas
    (:mod:`extproc.routing.hot`) are priced as each holding what the best of them holds: the set
    shares the prefix by design (the prewarmer sends it to a member that joins), so it is spread by
    load, as the hot-key design asks; priced as it stands, the holder was always cheapest and the
    set never spread (every hot request on one of four)."""
    matches = cycle.view.prefix_matches
    held = matches.get(state.name, 0)
    hot = cycle.hot_set
    if hot and state.name in hot:
        held = max(matches.get(name, 0) for name in hot)  # its own among them
    return held


def _output_tokens(features: RequestFeatures, settings: PriceSettings, learned: float | None = None) -> int:
    """The output the request is expected to decode: an agent's estimate (Dynamo's ``osl``, within
    its ``max_tokens``), else its ``max_tokens`` up to ``settings.max_output_tokens``, else what
    its model's answers came to (``learned``, :mod:`extproc.fleet.health.output_lengths`), else
    ``settings.output_tokens``."""
    fallback = max(1, round(learned)) if learned is not None else settings.output_tokens
    expected = features.expected_output_tokens
    if expected is None:
        return fallback
    if features.hints.expected_output_tokens is None and expected > settings.max_output_tokens:
        return fallback  # a cap beyond any likely answer: it says nothing of this one
    return expected


def _price(
    cycle: CycleState,
    state: ReplicaState,
    settings: PriceSettings,
    block_chars: int,
    new_conversation: bool,
    adapter: str = "",
    own: int = 0,
) -> Price:
    features = cycle.features
    rates = settings.rates(cycle, state)
    rate = rates.prefill_tokens_per_s
    view = cycle.view
    uncached = uncached_tokens(features, _held_blocks(cycle, state), block_chars)
    if state.name == view.pinned and view.pin_lost is None:
        # The pin's conversation is there until the replica itself says it is gone: an index that
        # forgot it is no evidence (``AffinityView.pin_lost``), so it lacks at most the turn's new part.
        uncached = min(uncached, settings.turn_tokens)
    batch = _batch(state)
    # The prefill ahead of it: what this gateway (and its peers) sent there and was not answered,
    # or, where the engine reports more requests waiting than that covers (other gateways, other
    # clients), ``waiting_tokens`` for each of those.
    queued = max(0, state.pending_prefill_tokens, state.queue * settings.waiting_tokens)
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
    learned = cycle.latency.output_tokens.get(features.model) if cycle.latency is not None else None
    output_tokens = _output_tokens(features, settings, learned)
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
    others += settings.evict_weight * uncached / rate * state.cache_fill
    future = 0.0
    if new_conversation and settings.session_tokens:
        future = state.live_sessions * settings.session_tokens / rate
    if settings.working_set_weight and features.session_key:
        future += settings.working_set_weight * working_set_overflow(state, own, view.pinned) / rate
    # An adapter being loaded for requests already waiting there (``adapters_waiting``) is as good as held.
    load = 0.0
    if adapter and adapter not in state.adapters and adapter not in state.adapters_waiting:
        load = settings.adapter_load_s
    return Price(prefill, queue, kv_wait, others, future, 0.0, uncached, rates, load)


def prices(
    cycle: CycleState,
    candidates: Sequence[ReplicaState],
    settings: PriceSettings,
    block_chars: int,
) -> dict[str, Price]:
    """Each candidate's price for this request, computed once per decision (kept on the cycle
    state). A session's pinned replica, if a candidate, is priced as it is; every other candidate
    is charged the move (``hysteresis`` of the pinned replica's price plus ``hysteresis_s``)."""
    if cycle.prices is not None:
        return cycle.prices
    pinned = cycle.view.pinned
    new_conversation = cycle.features.opens_conversation and pinned is None
    adapter = _adapter(cycle)
    own = 0
    if settings.working_set_weight and candidates:
        # The conversation's own history: what the replica holding least of it would compute.
        own = max(uncached_tokens(cycle.features, _held_blocks(cycle, c), block_chars) for c in candidates)
    out = {c.name: _price(cycle, c, settings, block_chars, new_conversation, adapter, own) for c in candidates}
    stay = out.get(pinned) if pinned is not None else None
    if stay is not None:
        margin = settings.hysteresis * stay.total_s + settings.hysteresis_s
        for name, p in out.items():
            if name != pinned:
                out[name] = replace(p, move_s=margin)
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
                out[name] = replace(p, move_s=margin * by_name[name].cache_fill)
    cycle.prices = out
    return out


def _adapter(cycle: CycleState) -> str:
    """The LoRA adapter the request names, empty for a base model: judged once a decision, over
    the whole fleet, so every price of the decision (the picker's, the objectives') agrees."""
    if cycle.adapter is None:
        model = cycle.features.model
        cycle.adapter = model if adapter_requested(model, cycle.snapshot.replicas) else ""
    return cycle.adapter


def predicted_ttft_s(cycle: CycleState, state: ReplicaState, settings: PriceSettings) -> float | None:
    """The price's time to first token of the request on ``state`` (:attr:`Price.ttft_s`): its
    parts depend on that candidate alone, so it is the same whatever else is a candidate. None where
    its rates are the built-in prior's: an H100's, not measured on this fleet, so no evidence to
    shed a request or break a pin on (the objectives' end-to-end test had its first request shed
    against an objective the built-in prior said it would miss, before anything was learnt)."""
    price = _price(cycle, state, settings, cycle.block_chars, False, _adapter(cycle))
    return None if price.rates.source == BUILT_IN_SOURCE else price.ttft_s


def prefill_here_s(cycle: CycleState, state: ReplicaState, settings: PriceSettings) -> float:
    """What prefilling the request on ``state`` costs: its time to first token there and what it
    costs the requests already there (``others``: the stall of the batch it decodes)."""
    p = _price(cycle, state, settings, cycle.block_chars, False, _adapter(cycle))
    return p.ttft_s + p.others_s


@dataclass(slots=True)
class PricePicker(PriceSettings):
    """Orders the candidates by their price, cheapest first (:func:`prices`). The profile's
    scorers only break what the price leaves about tied: each point of their weighted total is
    worth ``seconds_per_point`` off the price (the ring, at weight 0.1, keeps gateways without
    shared state in agreement on an idle fleet); then the name, for a deterministic order."""

    seconds_per_point: float = 0.001
    name: str = "price"

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates, cheapest first; the first is taken to be where the request goes."""
        priced = prices(cycle, candidates, self, cycle.block_chars)
        per_point = self.seconds_per_point
        ordered = sorted(
            candidates, key=lambda c: (priced[c.name].total_s - per_point * totals.get(c.name, 0.0), c.name)
        )
        return ordered


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
