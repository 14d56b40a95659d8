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
choice, not of the estimates. Our pair choice is :func:`extproc.routing.disagg.choose_pair`, with
sessions pinned to their decode replica; the peers' are those of vLLM's toy proxy (round robin)
and of a least-loaded proxy, without cache awareness or threshold.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.routing.disagg import PairInputs, PairSettings, choose_pair
from extproc.routing.model import Replica, ReplicaState
from extproc.routing.roles import ROLE_LABEL, Role
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
    prompt, the request's session and the replicas' roles."""

    states: tuple[ReplicaState, ...]
    cached: dict[str, int]
    prompt_tokens: int
    session: str | None


PairPolicy = Callable[[FleetView], Route]
"""Chooses a request's route from the fleet's state."""


def ours(settings: PairSettings | None = None) -> PairPolicy:
    """Our pair choice (:func:`~extproc.routing.disagg.choose_pair`), sessions pinned to their
    decode replica."""
    pins: dict[str, str] = {}

    def policy(view: FleetView) -> Route:
        pinned = pins.get(view.session) if view.session else None
        pair = choose_pair(PairInputs(view.states, view.prompt_tokens, view.cached, pinned), settings)
        if pair.decode is None:
            raise RuntimeError("no replica decodes")
        if view.session:
            pins[view.session] = pair.decode.name
        index = {s.name: i for i, s in enumerate(view.states)}
        return Route(index[pair.decode.name], None if pair.prefill is None else index[pair.prefill.name])

    return policy


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
        n = len(self.models)
        self._pending = [0] * n  # prefill tokens submitted and not yet computed, per replica
        self._uncached: dict[int, int] = {}  # id(seq) -> what it added to _pending
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
        self._uncached[id(seq)] = uncached
        super()._submit(m, seq, now)

    def _view(self, seq: Seq, session: str | None) -> FleetView:
        states = tuple(
            ReplicaState(
                replica,
                running=m.num_running,
                queue=m.num_waiting,
                kv_usage=m.kv_cache_usage_perc,
                pending_prefill_tokens=self._pending[i],
            )
            for i, (replica, m) in enumerate(zip(self.replicas, self.models, strict=True))
        )
        cached = {r.name: m.cached_prefix_tokens(seq) for r, m in zip(self.replicas, self.models, strict=True)}
        return FleetView(states, cached, seq.prompt_tokens, session)

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
                route = self.policy(self._view(seq, req.session and f"{req.tenant}\x1f{req.session}"))
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
