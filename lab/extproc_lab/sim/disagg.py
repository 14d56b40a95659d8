"""A disaggregated fleet on the virtual clock: prefill and decode replicas, each with its own
queue, and the KV transfer between them.

A request goes where its pair policy says (:data:`PairPolicy`): aggregated, to one replica that
prefills and decodes it; or disaggregated, as vLLM's proxy drives it: first to the prefill
replica with one output token, then, once that answers, to the decode replica, which pulls the
blocks it lacks (the profile's ``kv_transfer_s_per_block`` per block), takes them as cached and
computes only the rest (:meth:`~extproc_lab.replica.model.ReplicaModel.receive`). The client's
first token is the decode replica's; the prefill replica's token is the proxy's and is dropped.

Policies read the replicas' true state at the moment of the decision (their caches, queues and
KV usage, as llm-d's precise prefix index and a fresh scrape would): the comparison is of the
choice, not of the estimates. Ours is the router's own decision, the code the server runs:
:func:`extproc.api.decide` with a profile of the router's config (the decode replica
by its filters, scorers and picker among the replicas that decode, then the prefill hop by
:func:`extproc.routing.disagg.choose_prefill`), sessions pinned to where the decision pins them,
as the router's store does; the peers' are those of vLLM's toy proxy (round robin) and of a
least-loaded proxy, without cache awareness or threshold.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.api import (
    ROLE_LABEL,
    AffinityView,
    Config,
    DecisionInputs,
    FeatureSettings,
    PairSettings,
    Replica,
    ReplicaState,
    RequestFeatures,
    Role,
    Snapshot,
    build_profile,
    cache_fill,
    decide,
)
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.replica.timing import ReplicaProfile
from extproc_lab.sim.simulator import ReplicaSteps
from extproc_lab.sim.workload import Workload

_ARRIVAL, _TRANSFERRED, _STEP_END = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes: the replica that decodes it and the one that prefills it (None:
    aggregated on the decode replica)."""

    decode: int
    prefill: int | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """What a pair policy sees for one request: each replica's state and what it holds of the
    prompt, the request's session and the replicas' roles, the request's features as the router
    reads them, and the clock."""

    states: tuple[ReplicaState, ...]
    cached: dict[str, int]
    prompt_tokens: int
    session: str | None
    features: RequestFeatures | None = None
    now: float = 0.0
    block_tokens: int = 16


PairPolicy = Callable[[FleetView], Route]
"""Chooses a request's route from the fleet's state."""

LIVE_S = 60.0
"""A conversation is live on its replica for a minute after its last turn began (as the
router's replica book counts ``live_sessions``)."""


@dataclass
class _Sessions:
    """Pins and live conversations, as the router's store and replica book keep them."""

    pins: dict[str, str] = field(default_factory=dict)
    seen: OrderedDict[str, float] = field(default_factory=OrderedDict)
    own: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Per live session: the replica its last turn went to and the KV of its own it added there
    (a keyed session's, counted from its first turn, as the router does)."""

    def live(self, now: float) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the conversations pinned there and live, and the KV of their own."""
        while self.seen and next(iter(self.seen.values())) < now - LIVE_S:
            self.own.pop(self.seen.popitem(last=False)[0], None)
        counts: dict[str, int] = {}
        tokens: dict[str, int] = {}
        for session in self.seen:
            name = self.pins.get(session)
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
            where = self.own.get(session)
            if where is not None:
                tokens[where[0]] = tokens.get(where[0], 0) + where[1]
        return counts, tokens

    def turn(self, session: str, now: float, replica: str, tokens: int) -> None:
        self.seen[session] = now
        self.seen.move_to_end(session)
        was = self.own.get(session)
        # What it held on a replica it left is not carried to the next.
        held = was[1] if was is not None and was[0] == replica else 0
        self.own[session] = (replica, tokens + held)


def ours(
    settings: PairSettings | None = None,
    profile: Mapping[str, Any] | None = None,
) -> PairPolicy:
    """The router's own decision (:func:`extproc.api.decide`, as the server calls it)
    with ``profile`` (a config's ``profile:``; None: the router's default) and ``settings`` for the
    pair (None: the config's ``disaggregation:``); the view's true matches stand in for the
    router's cache view, sessions are pinned where the decision pins them."""
    config = Config()
    built = build_profile(profile if profile is not None else config.profile, vnodes=config.ring.vnodes)
    pairing = settings or PairSettings()
    block_chars = FeatureSettings().block_chars
    sessions = _Sessions()

    def policy(view: FleetView) -> Route:
        features = view.features
        if features is None:
            raise RuntimeError("the router's decision needs the request's features (FleetView.features)")
        pinned = sessions.pins.get(view.session) if view.session else None
        live, own = sessions.live(view.now)
        states = tuple(replace_live(s, live.get(s.name, 0), own.get(s.name, 0)) for s in view.states)
        # What each replica holds, in the prompt's blocks (the engine's block is the router's: 16 tokens).
        matches = {name: tokens // view.block_tokens for name, tokens in view.cached.items() if tokens > 0}
        given = DecisionInputs.of(
            features,
            Snapshot(states),
            AffinityView(pinned=pinned, prefix_matches=matches),
            view.now,
            built,
            pairing=pairing,
            block_chars=block_chars,
        )
        decision = decide(given)
        if decision.replica is None:
            raise RuntimeError("no replica decodes")
        if view.session:
            if decision.pin:
                sessions.pins[view.session] = decision.replica.name
            chosen = decision.replica.name
            sessions.turn(view.session, view.now, chosen, max(0, view.prompt_tokens - view.cached.get(chosen, 0)))
        index = {s.name: i for i, s in enumerate(view.states)}
        prefill = decision.prefill
        return Route(index[decision.replica.name], None if prefill is None else index[prefill.name])

    return policy


def replace_live(state: ReplicaState, live: int, own_tokens: int = 0) -> ReplicaState:
    """``state`` with ``live`` conversations live there, holding ``own_tokens`` of KV of their own."""
    if live == state.live_sessions and own_tokens == state.live_session_tokens:
        return state
    return replace(state, live_sessions=live, live_session_tokens=own_tokens)


def _load(state: ReplicaState) -> int:
    return state.running + state.queue


def peer(prefill_choice: str, seed: int = 7) -> PairPolicy:
    """A proxy without cache awareness: every request disaggregated, the decode replica the least
    loaded (fewest running and waiting, ties to the first), the prefill replica by
    ``prefill_choice``: ``"round_robin"`` (vLLM's toy proxy), ``"random"`` or ``"least_loaded"``."""
    rng = random.Random(seed)
    turn = 0

    def policy(view: FleetView) -> Route:
        nonlocal turn
        states = view.states
        decoders = [i for i, s in enumerate(states) if s.role is Role.DECODE]
        prefillers = [i for i, s in enumerate(states) if s.role is Role.PREFILL]
        decode = min(decoders, key=lambda i: _load(states[i]))
        if prefill_choice == "round_robin":
            prefill = prefillers[turn % len(prefillers)]
            turn += 1
        elif prefill_choice == "random":
            prefill = rng.choice(prefillers)
        else:
            prefill = min(prefillers, key=lambda i: _load(states[i]))
        return Route(decode, prefill)

    return policy


@dataclass(frozen=True, slots=True)
class DisaggOutcome:
    """One request as its client saw it, with where it went."""

    index: int
    arrival: float
    first_token: float
    finish: float
    prompt_tokens: int
    output_tokens: int
    decode: int
    prefill: int | None
    transfer_blocks: int
    decode_cached_tokens: int

    @property
    def ttft(self) -> float:
        """Time to first token, the decode replica's token."""
        return self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        """Mean time between output tokens (None with one token)."""
        if self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        """Arrival to last token."""
        return self.finish - self.arrival


@dataclass
class DisaggRun:
    """A run's outcomes and per-replica work."""

    roles: list[Role]
    outcomes: list[DisaggOutcome]
    busy_s: list[float]
    prefill_tokens: list[int]
    preemptions: list[int]


def fleet(prefill: int, decode: int, both: int = 0) -> list[Role]:
    """Roles of a fleet: ``prefill`` prefill replicas, ``decode`` decode ones, ``both`` aggregated."""
    return [Role.PREFILL] * prefill + [Role.DECODE] * decode + [Role.BOTH] * both


class DisaggSimulation(ReplicaSteps):
    """One pair policy over one workload on a fleet of ``roles``, all of ``profile``."""

    STEP_END = _STEP_END

    def __init__(
        self,
        workload: Workload,
        profile: ReplicaProfile,
        roles: Sequence[Role],
        policy: PairPolicy,
        *,
        max_run_steps: int = 1 << 20,
    ) -> None:
        if not any(r.decodes for r in roles):
            raise ValueError("a fleet needs a replica that decodes")
        self.workload = workload
        self.profile = profile
        self.roles = list(roles)
        self.policy = policy
        self.max_run_steps = max_run_steps
        self.replicas = [
            Replica(f"{r.value}-{i}", f"sim:{i}", labels={ROLE_LABEL: r.value}) for i, r in enumerate(self.roles)
        ]
        self.models = [ReplicaModel(profile) for _ in self.roles]
        self._features = FeatureSettings()
        n = len(self.models)
        self._pending = [0] * n  # prefill tokens submitted and not yet computed, per replica
        self._uncached: dict[int, int] = {}  # id(seq) -> what it added to _pending
        self._written = [0] * n  # uncached prompt tokens sent there, as the router's book counts them
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._order = 0
        self._version = [0] * n
        self._step_start = [0.0] * n
        self._scheduled_end = [0.0] * n

    # --- the replicas ------------------------------------------------------------------------

    def _submit(self, m: int, seq: Seq, now: float) -> None:
        """Hand ``seq`` to replica model ``m``, counting its uncached prompt as pending there."""
        uncached = seq.prompt_tokens - self.models[m].cached_prefix_tokens(seq)
        self._pending[m] += uncached
        self._written[m] += uncached
        self._uncached[id(seq)] = uncached
        super()._submit(m, seq, now)

    def _view(self, seq: Seq, session: str | None, features: RequestFeatures, now: float) -> FleetView:
        capacity = self.profile.num_gpu_blocks * self.profile.block_size
        states = tuple(
            ReplicaState(
                replica,
                # The router counts its own requests in flight; here every request is its own.
                inflight=m.num_running + m.num_waiting,
                running=m.num_running,
                queue=m.num_waiting,
                kv_usage=m.kv_cache_usage_perc,
                kv_capacity_tokens=capacity,
                pending_prefill_tokens=self._pending[i],
                cache_fill=cache_fill(self._written[i], capacity),
            )
            for i, (replica, m) in enumerate(zip(self.replicas, self.models, strict=True))
        )
        cached = {r.name: m.cached_prefix_tokens(seq) for r, m in zip(self.replicas, self.models, strict=True)}
        return FleetView(states, cached, seq.prompt_tokens, session, features, now, self.profile.block_size)

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> DisaggRun:
        """Replay the workload to its end."""
        reqs = self.workload.requests
        followers = self.workload.followers()
        decode_seq: dict[int, Seq] = {}
        routes: dict[int, Route] = {}
        transfers: dict[int, int] = {}
        arrival: dict[int, float] = {}
        outcomes: list[DisaggOutcome] = []
        for r in reqs:
            if r.after < 0:
                self._push(r.arrival_s, _ARRIVAL, r.index)
        heap = self._heap
        while heap:
            now, kind, _, a, b = heapq.heappop(heap)
            if kind == _ARRIVAL:
                req = reqs[a]
                seq = Seq(
                    req.request_id,
                    req.prompt_tokens,
                    req.output_tokens,
                    req.keys,
                    req.key_span,
                    req.tail_span,
                    handle=a,
                )
                features = req.features(self._features, objectives=False)
                route = self.policy(self._view(seq, req.session and f"{req.tenant}\x1f{req.session}", features, now))
                if not self.roles[route.decode].decodes or (
                    route.prefill is not None and not self.roles[route.prefill].prefills
                ):
                    raise RuntimeError(f"the policy sent request {a} to a replica of another role")
                decode_seq[a], routes[a], arrival[a] = seq, route, now
                if route.prefill is None:
                    self._submit(route.decode, seq, now)
                else:
                    hop = Seq(seq.request_id + "/prefill", seq.prompt_tokens, 1, seq.keys, seq.key_span, seq.tail_span)
                    hop.handle = -1 - a
                    self._submit(route.prefill, hop, now)
            elif kind == _TRANSFERRED:
                seq, m = decode_seq[a], routes[a].decode
                self.models[m].receive(seq, len(seq.keys))
                self._submit(m, seq, now)
            else:
                if self._version[a] != b:
                    continue  # a run cut short: its new end is in the heap
                model = self.models[a]
                result = model.end_step()
                for seq in result.first:
                    self._pending[a] -= self._uncached.pop(id(seq))
                for seq in result.finished:
                    if seq.handle < 0:  # a prefill hop answered: the decode replica pulls its blocks
                        i = -1 - seq.handle
                        dm = routes[i].decode
                        blocks = self.models[dm].missing_blocks(decode_seq[i], len(seq.keys))
                        transfers[i] = blocks
                        self._push(now + blocks * self.profile.kv_transfer_s_per_block, _TRANSFERRED, i)
                        continue
                    i = seq.handle
                    route = routes.pop(i)
                    outcomes.append(
                        DisaggOutcome(
                            i,
                            arrival.pop(i),
                            seq.first_token_at,
                            seq.finished_at,
                            seq.prompt_tokens,
                            seq.output_tokens,
                            route.decode,
                            route.prefill,
                            transfers.pop(i, 0),
                            max(0, seq.cached_tokens),
                        )
                    )
                    del decode_seq[i]
                    for f in followers.get(i, ()):
                        self._push(now + reqs[f].arrival_s, _ARRIVAL, f)
                self._start_step(a, now)
        if decode_seq:
            raise RuntimeError(f"{len(decode_seq)} requests never finished")
        models = self.models
        return DisaggRun(
            self.roles,
            sorted(outcomes, key=lambda o: o.index),
            [m.busy_s for m in models],
            [m.prefill_tokens_computed for m in models],
            [m.preemptions for m in models],
        )
