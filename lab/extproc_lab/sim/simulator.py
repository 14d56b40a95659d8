"""A discrete-event simulator: a workload, the router, and replica models on a virtual clock.

It drives the very objects the ext_proc server drives, without sockets, through the router's
synchronous driver (:class:`~extproc.api.sim.SyncDriver`): a router built with the virtual clock and
a memory store routes each request (``route``), learns of its first token (``first_token``), of
its last and of its end (``finished``), and takes in each replica's load as a scraper would
(``scrape``, then ``evaluate``, every scrape interval). Replicas are
:class:`~extproc_lab.replica.model.ReplicaModel` instances, the model behind the fake HTTP replica.

Events are arrivals (open loop at their time, closed loop a think time after what they follow)
and ends of replica steps; the variants (:mod:`~extproc_lab.sim.dynamic`,
:mod:`~extproc_lab.sim.priority`) add their own kinds and hooks to this one loop. Two things keep a
replay of hours of traffic fast:

- runs of identical decode steps are one event (the model's ``max_steps``), cut short at the
  next step boundary when a request arrives at that replica;
- scrapes are taken lazily: the router only reads load at decisions, and nothing changes between
  events, so the report a scrape at tick ``k`` would have produced is the state when the first
  event after that tick is popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.api import (
    Config,
    Metrics,
    Profile,
    Replica,
    ReplicaMetrics,
    RequestFeatures,
    Routed,
    build_profile,
    decide,
    with_overrides,
)
from extproc.api.sim import Decider, Prewarmer, SyncDriver
from extproc_lab.peers import PeerDecision, PeerPolicy
from extproc_lab.replica.model import ReplicaModel, Seq, StepResult
from extproc_lab.replica.timing import ReplicaProfile
from extproc_lab.sim.kv_feed import SimKvFeed
from extproc_lab.sim.workload import Workload

_ARRIVAL, _STEP_END = 0, 1  # at equal times an arrival goes first: it joins the next step


def scrape(model: ReplicaModel) -> ReplicaMetrics:
    """What the scraper would read from the model's /metrics page: load, prefix-cache counters
    and the cache's size (``vllm:cache_config_info``)."""
    return ReplicaMetrics(
        running=model.num_running,
        waiting=model.num_waiting,
        kv_usage=model.kv_cache_usage_perc,
        prefix_queries=float(model.prefix_queries_tokens),
        prefix_hits=float(model.prefix_hits_tokens),
        preemptions=float(model.preemptions),
        block_size=model.profile.block_size,
        num_gpu_blocks=model.profile.num_gpu_blocks,
    )


def _seed_of(workload: Workload) -> int:
    """The workload's seed, as its generator recorded it (0 when it has none, as a trace's)."""
    seed = workload.info.get("seed", 0)
    return seed if isinstance(seed, int) else 0


class VirtualClock:
    """The simulator's clock: it reads what the event loop last set."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Outcome:
    """One request's fate, for the figures."""

    index: int
    replica: int
    arrival: float
    first_token: float
    finish: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    output_tokens: int
    preemptions: int
    session: str | None
    stayed: bool | None


@dataclass
class SimRun:
    """Everything a run produced: outcomes per request and per-replica, per-window series."""

    policy: str
    replicas: list[str]
    outcomes: list[Outcome]
    busy_s: list[float]
    prefill_tokens: list[int]
    preemptions: list[int]
    window_s: float
    requests_series: list[list[int]]
    tokens_series: list[list[float]]
    decisions: dict[str, int] = field(default_factory=dict)
    events: int = 0
    reuse_blocks: tuple[int, int, int] = (0, 0, 0)
    """The router's hit-ratio ledger over the run (``extproc.fleet.cache.reuse``): prefix blocks routed,
    offered (held by some replica of the pool), captured (held by the replica chosen)."""


@dataclass(slots=True)
class RouteTally:
    """What the event loop notes when a request is routed or finishes: requests per replica per
    window, and whether a session's turn went where its previous turn went."""

    window_s: float
    counts: list[list[int]]  # per replica, per window; a joining replica appends its own list
    stayed: dict[int, bool] = field(default_factory=dict)
    last_replica: dict[str, int] = field(default_factory=dict)

    def routed(self, index: int, replica: int, now: float, tenant: str, session: str | None) -> None:
        """Request ``index`` was sent to ``replica`` at ``now``."""
        w = int(now // self.window_s)
        series = self.counts[replica]
        while len(series) <= w:
            series.append(0)
        series[w] += 1
        if session is not None:
            key = f"{tenant}\x1f{session}"
            prev = self.last_replica.get(key)
            if prev is not None:
                self.stayed[index] = prev == replica
            self.last_replica[key] = replica

    def outcome(self, index: int, replica: int, seq: Seq, session: str | None) -> Outcome:
        """The finished request's :class:`Outcome`."""
        return Outcome(
            index=index,
            replica=replica,
            arrival=seq.arrived_at,
            first_token=seq.first_token_at,
            finish=seq.finished_at,
            prompt_tokens=seq.prompt_tokens,
            cached_tokens=max(0, seq.cached_tokens),
            prefill_tokens=seq.prefill_tokens,
            output_tokens=seq.output_tokens,
            preemptions=seq.preemptions,
            session=session,
            stayed=self.stayed.get(index),
        )


class SimCacheProbe:
    """What every replica model holds of the request being routed (Dynamo's and llm-d's KV-event
    view). Only answers for the request the simulator is routing."""

    def __init__(self, sim: Simulation) -> None:
        self._sim = sim

    def cached_tokens(self, features: RequestFeatures) -> Mapping[str, int]:
        """True cached prefix tokens per replica."""
        seq = self._sim.routing
        if seq is None or seq.request_id != features.request_id:
            return {}
        return {name: m.cached_prefix_tokens(seq) for name, m in zip(self._sim.names, self._sim.models, strict=True)}

    def active_blocks(self) -> Mapping[str, int]:
        """Blocks each replica's running requests hold now."""
        return {name: m.pool.used_blocks for name, m in zip(self._sim.names, self._sim.models, strict=True)}


ProfileFactory = Callable[[SimCacheProbe], Profile | PeerPolicy | None]
"""What a run routes with, given the probe: a profile of our pipeline (None: the config's), or a
peer router's policy, which the run then owns."""


class ReplicaSteps:
    """Replica models stepped on one event heap. A step's (or run's) end is an event of kind
    ``STEP_END`` carrying the replica and the step's version: a run cut short by an arrival gets
    a new end and a new version, and its old end event is skipped as stale. The loops that use it
    (:class:`Simulation`, :class:`~extproc_lab.sim.disagg.DisaggSimulation`) own the lists."""

    STEP_END = _STEP_END
    models: list[ReplicaModel]
    max_run_steps: int
    _heap: list[tuple[float, int, int, int, int]]
    _order: int
    _version: list[int]
    _step_start: list[float]
    _scheduled_end: list[float]

    def _push(self, at: float, kind: int, a: int, b: int = 0) -> None:
        """Schedule an event; at equal times the lower kind, then the earlier push, goes first."""
        heapq.heappush(self._heap, (at, kind, self._order, a, b))
        self._order += 1

    def _start_step(self, m: int, now: float) -> None:
        duration = self.models[m].begin_step(now, self.max_run_steps)
        if duration is None:
            return
        self._version[m] += 1
        self._step_start[m] = now
        self._scheduled_end[m] = now + duration
        self._push(now + duration, self.STEP_END, m, self._version[m])

    def _submit(self, m: int, seq: Seq, now: float) -> None:
        """Hand ``seq`` to replica model ``m`` at ``now``."""
        model = self.models[m]
        if model.busy:
            end = model.cut(now)
            if end != self._scheduled_end[m]:
                # The run now ends sooner: its old end event is stale.
                self._version[m] += 1
                self._scheduled_end[m] = end
                self._push(end, self.STEP_END, m, self._version[m])
        model.submit(seq, now)
        if not model.busy:
            self._start_step(m, now)


class Simulation(ReplicaSteps):
    """One policy over one workload on ``replicas`` model replicas of ``profile``: the event loop.

    ``make_profile`` builds the routing profile (it is given a probe of the replicas' true
    caches, for Dynamo's and llm-d's KV-event view; None: the config's profile), or a peer
    router's policy (:class:`~extproc_lab.peers.PeerPolicy`): the run keeps it as ``peer``, the
    router decides through it (:class:`~extproc_lab.peers.PeerDecision`) and the run tells it
    where each request went. ``config`` is
    the router's (replicas are set here); ``scrape_interval_s`` defaults to its health settings'
    interval. Requests carry their latency objectives to the router unless ``objectives`` is False
    (they are still judged by them). ``slower`` makes the last ``n`` replicas of another profile
    (a mixed pool), ``(n, profile)``. ``seed`` seeds the router's chance (new keyless
    conversations' identities); by default the workload's seed (``info["seed"]``, else 0), so
    that a run repeats exactly.

    The loop is the lab's one for routed requests: its variants extend it through hooks, not
    copies (a disaggregated fleet, whose requests are two hops and no router's, has its own, on
    the same :class:`ReplicaSteps`).
    :class:`~extproc_lab.sim.dynamic.DynamicSimulation` adds scheduled fleet changes and
    pre-warms (:meth:`_initial_events`, :meth:`_on_event`, :meth:`_add_replica`,
    :meth:`_submit_side`) and refusals (:meth:`_decided`, :meth:`_refused`);
    :class:`~extproc_lab.sim.priority.PrioritySimulation` holds requests before they are routed
    (:meth:`_arrive`, :meth:`_dispatch`, :meth:`_scrape`, :meth:`_after_step`) and records its
    own outcomes (:meth:`_finished`). Event kinds ``ARRIVAL`` and ``STEP_END`` are the loop's;
    a variant's own kinds go below (before an arrival at the same time) or above them.
    """

    ARRIVAL = _ARRIVAL

    def __init__(
        self,
        workload: Workload,
        profile: ReplicaProfile,
        replicas: int,
        make_profile: ProfileFactory,
        *,
        policy: str = "policy",
        config: Config | None = None,
        scrape_interval_s: float | None = None,
        window_s: float | None = None,
        max_run_steps: int = 1 << 20,
        kv_events_delay_s: float | None = None,
        objectives: bool = True,
        slower: tuple[int, ReplicaProfile] | None = None,
        seed: int | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.workload = workload
        self.policy = policy
        self.objectives = objectives
        self.names = [f"replica-{i}" for i in range(replicas)]
        members = tuple(Replica(n, f"sim:{i}") for i, n in enumerate(self.names))
        base = config or Config()
        self.config = with_overrides(base, replicas=members, metrics=Metrics(enabled=False))
        self.clock = VirtualClock()
        self.probe = SimCacheProbe(self)
        self.routing: Seq | None = None
        routing = make_profile(self.probe)
        self.peer: PeerPolicy | None = None
        decider: Decider = decide
        if routing is None or isinstance(routing, Profile):
            routing_profile = routing
        else:
            self.peer, decider = routing, PeerDecision(routing)
            # Only what the decision states from the request (the key source, the fallbacks):
            # the peer ranks the replicas itself.
            routing_profile = build_profile(
                {"filters": [], "scorers": [], "picker": {"type": "max_score"}, "name": routing.name},
                vnodes=self.config.ring.vnodes,
                ring_key_blocks=self.config.ring.key_blocks,
            )
        slow, slow_profile = slower or (0, profile)
        self.models = [ReplicaModel(profile if i < replicas - slow else slow_profile) for i in range(replicas)]
        # The kv_events policy: the models' stores and evictions reach the router as KV events.
        self.kv_feed = (
            None if kv_events_delay_s is None else SimKvFeed(self.names, self.models, self.clock, kv_events_delay_s)
        )
        kv_events = self.kv_feed.state if self.kv_feed is not None else None
        self.driver = SyncDriver(
            self.config,
            self.clock,
            profile=routing_profile,
            prewarmer=self._prewarmer(),
            kv_events=kv_events,
            decider=decider,
            seed=_seed_of(workload) if seed is None else seed,
        )
        self.scrape_interval_s = scrape_interval_s or self.config.health.scrape_interval_s
        # The health evaluation only matters to profiles that filter on rotation.
        filters = routing_profile.filters if routing_profile is not None else ()
        self._evaluate = any(getattr(f, "name", "") == "in_rotation" for f in filters)
        self.max_run_steps = max_run_steps
        nominal = workload.nominal_order()
        span = max((r.arrival_s for r in nominal if r.after < 0), default=0.0)
        self.window_s = window_s or max(1.0, span / 60)
        self.index_of = {name: i for i, name in enumerate(self.names)}
        self._reset()

    def _prewarmer(self) -> Prewarmer | None:
        """The router's pre-warmer (None: the router's own, which sends HTTP)."""
        return None

    # --- the loop's state and the moves its hooks may make -----------------------------------

    def _reset(self) -> None:
        n = len(self.models)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._order = 0
        self._version = [0] * n
        self._step_start = [0.0] * n
        self._scheduled_end = [0.0] * n
        self._counts: list[list[int]] = [[] for _ in range(n)]
        self._work: list[list[float]] = [[] for _ in range(n)]
        self._tally = RouteTally(self.window_s, self._counts)
        self._seqs: dict[int, Seq] = {}
        self._routed: dict[int, Routed] = {}
        self._replica_of: dict[int, int] = {}
        self._outcomes: list[Outcome] = []
        self._decisions: dict[str, int] = {}
        self._side_pending = 0
        self._events = 0

    def _submit_side(self, m: int, seq: Seq) -> None:
        """Work that is not the workload's (a pre-warm; ``seq.handle`` < 0) on model ``m`` now:
        it loads the replica and is awaited at the end, and produces no outcome."""
        self._side_pending += 1
        self._submit(m, seq, self.clock.now)

    def _add_replica(self) -> int:
        """A new replica model (named ``replica-<index>``) in the loop; returns its index."""
        i = len(self.models)
        name = f"replica-{i}"
        self.names.append(name)
        self.index_of[name] = i
        self.models.append(ReplicaModel(self.models[0].profile))
        self._version.append(0)
        self._step_start.append(0.0)
        self._scheduled_end.append(0.0)
        self._counts.append([])
        self._work.append([])
        return i

    def _add_work(self, m: int, start: float, end: float, tokens: int) -> None:
        # Tokens computed per window, spread evenly over the step (or run) that computed them.
        window = self.window_s
        series = self._work[m]
        rate = tokens / (end - start) if end > start else 0.0
        while start < end:
            w = int(start // window)
            if (w + 1) * window <= start:
                w += 1  # start sits on a window edge that floor division put one window early
            while len(series) <= w:
                series.append(0.0)
            edge = min(end, (w + 1) * window)
            series[w] += (edge - start) * rate
            start = edge

    def _dispatch(self, i: int, features: RequestFeatures, now: float, *, may_wait: bool = False) -> None:
        """Route workload request ``i`` now and hand it to the replica chosen; with ``may_wait``
        one whose class queues on a predicted miss of its objectives comes back to :meth:`_refused`
        unrouted (``objective_wait`` set), for the variant's queue to hold."""
        req = self.workload.requests[i]
        seq = Seq(req.request_id, req.prompt_tokens, req.output_tokens, req.keys, req.key_span, req.tail_span, handle=i)
        self.routing = seq
        if self.kv_feed is not None:
            self.kv_feed.deliver(now)
            features = self.kv_feed.features(features, req, self.config.features.max_blocks)
        if features.conversation is not None and self.peer is None:
            # Our router knows a keyless conversation by its messages, as Router.route does; the
            # peers' policies see no session.
            features = self.driver.identify(features, now)
        decision = self.driver.route(features, now, may_wait=may_wait)
        self.routing = None
        reason = decision.decision.reason.value
        self._decisions[reason] = self._decisions.get(reason, 0) + 1
        self._decided(i, features, decision, now)
        chosen = decision.decision.replica
        if chosen is None:
            self._refused(i, decision, now)
            return
        if self.peer is not None:
            self.peer.observe(features, chosen.name)
        m = self.index_of[chosen.name]
        self._seqs[i] = seq
        self._routed[i] = decision
        self._replica_of[i] = m
        self._tally.routed(i, m, now, req.tenant, req.session)
        self._submit(m, seq, now)

    # --- hooks -------------------------------------------------------------------------------

    def _initial_events(self) -> list[tuple[float, int, int]]:
        """Events known before the run, ``(at, kind, a)``, after the open-loop arrivals."""
        return []

    def _scrape(self, at: float, now: float) -> None:
        """What a scrape at ``at`` would have read (nothing changed since): into the replica book."""
        driver = self.driver
        for name, model in zip(self.names, self.models, strict=True):
            driver.scrape(name, scrape(model), at)
        if self._evaluate:
            driver.evaluate(at)

    def _arrive(self, i: int, now: float) -> None:
        """Workload request ``i`` arrives: routed at once."""
        self._dispatch(i, self.workload.requests[i].features(self.config.features, self.objectives), now)

    def _decided(self, i: int, features: RequestFeatures, routed: Routed, now: float) -> None:
        """The router decided on request ``i`` (it may have refused it)."""

    def _refused(self, i: int, routed: Routed, now: float) -> None:
        """The router chose no replica for request ``i``."""
        raise RuntimeError("the router chose no replica")

    def _finished(self, i: int, seq: Seq) -> None:
        """Workload request ``i`` finished: its outcome."""
        self._outcomes.append(self._tally.outcome(i, self._replica_of[i], seq, self.workload.requests[i].session))

    def _after_step(self, result: StepResult, now: float) -> None:
        """After a replica's step ended and its next began."""

    def _on_event(self, kind: int, a: int, now: float) -> None:
        """An event of a variant's own kind."""
        raise RuntimeError(f"unknown event kind {kind}")

    # --- the event loop ----------------------------------------------------------------------

    def _loop(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> None:
        """Replay the workload to its end; ``on_progress(n)`` is called with requests finished."""
        self._reset()
        reqs = self.workload.requests
        followers = self.workload.followers()
        heap = self._heap
        for r in reqs:
            if r.after < 0:
                heap.append((r.arrival_s, _ARRIVAL, self._order, r.index, 0))
                self._order += 1
        for at, kind, a in self._initial_events():
            heap.append((at, kind, self._order, a, 0))
            self._order += 1
        heapq.heapify(heap)
        version = self._version
        models = self.models
        routed = self._routed
        interval = self.scrape_interval_s
        last_tick = -1
        clock = self.clock
        driver = self.driver
        push = self._push
        done = 0
        while heap:
            now, kind, _, a, b = heapq.heappop(heap)
            if kind == _STEP_END and version[a] != b:
                continue  # a run that was cut short: its new end is in the heap
            self._events += 1
            clock.now = now
            tick = int(now // interval)
            if tick > last_tick:
                last_tick = tick
                self._scrape(tick * interval, now)
            if kind == _ARRIVAL:
                self._arrive(a, now)
                continue
            if kind != _STEP_END:
                self._on_event(kind, a, now)
                continue
            # The end of a step (or of a run of decode steps) on replica a.
            model = models[a]
            result = model.end_step()
            self._add_work(a, self._step_start[a], now, result.tokens)
            for seq in result.first:
                if seq.handle >= 0:  # a pre-warm's first token is no request's
                    driver.first_token(routed[seq.handle], now)
            for seq in result.finished:
                i = seq.handle
                if i < 0:
                    self._side_pending -= 1
                    continue
                over = routed.pop(i)
                driver.finished(over, seq.first_token_at, seq.finished_at, seq.generated)
                self._finished(i, seq)
                del self._seqs[i]
                for f in followers.get(i, ()):
                    push(now + reqs[f].arrival_s, _ARRIVAL, f)
                done += 1
                if on_progress is not None and done % progress_every == 0:
                    on_progress(done)
            self._start_step(a, now)
            self._after_step(result, now)
        if on_progress is not None:
            on_progress(done)
        if self._seqs or self._side_pending:
            raise RuntimeError(f"{len(self._seqs)} requests and {self._side_pending} side requests never finished")

    def run(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> SimRun:
        """Replay the workload to its end; ``on_progress(n)`` is called with requests finished."""
        self._loop(on_progress, progress_every)
        return self._sim_run()

    def _sim_run(self) -> SimRun:
        outcomes = sorted(self._outcomes, key=lambda o: o.index)
        models = self.models
        return SimRun(
            policy=self.policy,
            replicas=list(self.names),
            outcomes=outcomes,
            busy_s=[m.busy_s for m in models],
            prefill_tokens=[m.prefill_tokens_computed for m in models],
            preemptions=[m.preemptions for m in models],
            window_s=self.window_s,
            requests_series=self._counts,
            tokens_series=self._work,
            decisions=dict(sorted(self._decisions.items())),
            events=self._events,
            reuse_blocks=self.driver.reuse_blocks(),
        )


def simulate(
    workload: Workload,
    profile: ReplicaProfile,
    replicas: int,
    make_profile: ProfileFactory,
    **options: Any,
) -> SimRun:
    """Run one :class:`Simulation` to its end."""
    on_progress = options.pop("on_progress", None)
    return Simulation(workload, profile, replicas, make_profile, **options).run(on_progress)
