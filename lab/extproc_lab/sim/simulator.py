"""A discrete-event simulator: a workload, the router, and replica models on a virtual clock.

It drives the very objects the ext_proc server drives, without sockets: a
:class:`~extproc.router.Router` built with the virtual clock and a memory store routes each
request (:meth:`~extproc.router.Router.route_features`), learns of its first token
(:meth:`~extproc.router.Router.observe_response`) and of its end
(:meth:`~extproc.router.Router.release`), and takes in each replica's load as a scraper would
(:meth:`~extproc.health.replicas.ReplicaBook.apply_report`, then ``evaluate``, every scrape
interval). Replicas are :class:`~extproc_lab.replica.model.ReplicaModel` instances, the model behind
the fake HTTP replica.

Events are arrivals (open loop at their time, closed loop a think time after what they follow)
and ends of replica steps. Two things keep a replay of hours of traffic fast:

- runs of identical decode steps are one event (the model's ``max_steps``), cut short at the
  next step boundary when a request arrives at that replica;
- scrapes are taken lazily: the router only reads load at decisions, and nothing changes between
  events, so the report a scrape at tick ``k`` would have produced is the state when the first
  event after that tick is popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from extproc.config import Config
from extproc.health.vllm_metrics import ReplicaMetrics
from extproc.rebalance.prewarm import Prewarmer
from extproc.request.features import RequestFeatures
from extproc.router import Routed, Router
from extproc.routing.model import Replica
from extproc.routing.pipeline import Profile
from extproc.state.memory import MemoryStore
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.replica.timing import ReplicaProfile
from extproc_lab.sim.kv_feed import SimKvFeed
from extproc_lab.sim.workload import Workload

T = TypeVar("T")

_ARRIVAL, _STEP_END = 0, 1  # at equal times an arrival goes first: it joins the next step


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never really waits (the memory store's) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    coro.close()
    raise RuntimeError("the simulator needs a store that answers without waiting (the memory store)")


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


@dataclass(slots=True)
class RouteTally:
    """What both simulators note when a request is routed or finishes: requests per replica per
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
    """What every replica model holds of the request being routed (the oracle's and Dynamo's
    KV-event view). Only answers for the request the simulator is routing."""

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


ProfileFactory = Callable[[SimCacheProbe], Profile]


class Simulation:
    """One policy over one workload on ``replicas`` model replicas of ``profile``.

    ``make_profile`` builds the routing profile (it is given a probe of the replicas' true
    caches, for the oracle and for Dynamo's KV events). ``config`` is the router's (replicas are
    set here); ``scrape_interval_s`` defaults to its health settings' interval.
    """

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
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.workload = workload
        self.policy = policy
        self.names = [f"replica-{i}" for i in range(replicas)]
        members = tuple(Replica(n, f"sim:{i}") for i, n in enumerate(self.names))
        base = config or Config()
        self.config = replace(base, replicas=members, metrics_listen=None)
        self.clock = VirtualClock()
        self.probe = SimCacheProbe(self)
        self.routing: Seq | None = None
        routing_profile = make_profile(self.probe)
        store = MemoryStore(self.config.session_ttl_s, self.config.max_sessions, self.config.blocks_per_replica)
        self.models = [ReplicaModel(profile) for _ in range(replicas)]
        # The kv_events policy: the models' stores and evictions reach the router as KV events.
        self.kv_feed = (
            None if kv_events_delay_s is None else SimKvFeed(self.names, self.models, self.clock, kv_events_delay_s)
        )
        kv_events = self.kv_feed.state if self.kv_feed is not None else None
        self.router = Router(
            self.config,
            store=store,
            clock=self.clock,
            profile=routing_profile,
            prewarmer=self._prewarmer(),
            kv_events=kv_events,
        )
        self.scrape_interval_s = scrape_interval_s or self.config.health.scrape_interval_s
        # The health evaluation only matters to profiles that filter on rotation.
        self._evaluate = any(getattr(f, "name", "") == "in_rotation" for f in routing_profile.filters)
        self.max_run_steps = max_run_steps
        nominal = workload.nominal_order()
        span = max((r.arrival_s for r in nominal if r.after < 0), default=0.0)
        self.window_s = window_s or max(1.0, span / 60)

    def _prewarmer(self) -> Prewarmer | None:
        """The router's pre-warmer (None: the router's own, which sends HTTP)."""
        return None

    # --- the event loop ----------------------------------------------------------------------

    def run(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> SimRun:
        """Replay the workload to its end; ``on_progress(n)`` is called with requests finished."""
        reqs = self.workload.requests
        followers = self.workload.followers()
        heap: list[tuple[float, int, int, int, int]] = []
        order = 0
        for r in reqs:
            if r.after < 0:
                heap.append((r.arrival_s, _ARRIVAL, order, r.index, 0))
                order += 1
        heapq.heapify(heap)
        n = len(self.models)
        version = [0] * n
        seqs: dict[int, Seq] = {}
        routed: dict[int, Routed] = {}
        replica_of: dict[int, int] = {}
        step_start = [0.0] * n
        scheduled_end = [0.0] * n
        counts: list[list[int]] = [[] for _ in range(n)]
        work: list[list[float]] = [[] for _ in range(n)]
        window = self.window_s
        tally = RouteTally(window, counts)
        interval = self.scrape_interval_s
        last_tick = -1
        book = self.router.replicas
        models = self.models
        names = self.names
        index_of = {name: i for i, name in enumerate(names)}
        settings = self.config.features
        clock = self.clock
        router = self.router
        outcomes: list[Outcome] = []
        decisions: dict[str, int] = {}
        events = 0
        done = 0

        def add_work(m: int, start: float, end: float, tokens: int) -> None:
            # Tokens computed per window, spread evenly over the step (or run) that computed them.
            series = work[m]
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

        def start_step(m: int, now: float) -> None:
            nonlocal order
            duration = models[m].begin_step(now, self.max_run_steps)
            if duration is None:
                return
            version[m] += 1
            step_start[m] = now
            scheduled_end[m] = now + duration
            heapq.heappush(heap, (now + duration, _STEP_END, order, m, version[m]))
            order += 1

        while heap:
            now, kind, _, a, b = heapq.heappop(heap)
            if kind == _STEP_END and version[a] != b:
                continue  # a run that was cut short: its new end is in the heap
            events += 1
            clock.now = now
            tick = int(now // interval)
            if tick > last_tick:
                # What a scrape at that tick would have read: nothing changed since.
                last_tick = tick
                at = tick * interval
                for i, model in enumerate(models):
                    book.apply_scrape(names[i], scrape(model), at)
                if self._evaluate:
                    book.evaluate(at)
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
                self.routing = seq
                features = req.features(settings)
                if self.kv_feed is not None:
                    self.kv_feed.deliver(now)
                    features = self.kv_feed.features(features, req, settings.max_blocks)
                decision = run_sync(router.route_features(features, now))
                self.routing = None
                chosen = decision.decision.replica
                if chosen is None:
                    raise RuntimeError("the router chose no replica")
                m = index_of[chosen.name]
                reason = decision.decision.reason.value
                decisions[reason] = decisions.get(reason, 0) + 1
                seqs[a] = seq
                routed[a] = decision
                replica_of[a] = m
                tally.routed(a, m, now, req.tenant, req.session)
                model = models[m]
                if model.busy:
                    end = model.cut(now)
                    if end != scheduled_end[m]:
                        # The run now ends sooner: its old end event is stale.
                        version[m] += 1
                        scheduled_end[m] = end
                        heapq.heappush(heap, (end, _STEP_END, order, m, version[m]))
                        order += 1
                model.submit(seq, now)
                if not model.busy:
                    start_step(m, now)
                continue
            # The end of a step (or of a run of decode steps) on replica a.
            model = models[a]
            result = model.end_step()
            add_work(a, step_start[a], now, result.tokens)
            for seq in result.first:
                if router.sample_response():  # as the processor asks Envoy for response headers
                    router.observe_response(routed[seq.handle], 200)
            for seq in result.finished:
                i = seq.handle
                router.release(routed.pop(i))
                outcomes.append(tally.outcome(i, replica_of[i], seq, reqs[i].session))
                del seqs[i]
                for f in followers.get(i, ()):
                    heapq.heappush(heap, (now + reqs[f].arrival_s, _ARRIVAL, order, f, 0))
                    order += 1
                done += 1
                if on_progress is not None and done % progress_every == 0:
                    on_progress(done)
            start_step(a, now)
        if on_progress is not None:
            on_progress(done)
        if seqs:
            raise RuntimeError(f"{len(seqs)} requests never finished")
        outcomes.sort(key=lambda o: o.index)
        return SimRun(
            policy=self.policy,
            replicas=list(names),
            outcomes=outcomes,
            busy_s=[m.busy_s for m in models],
            prefill_tokens=[m.prefill_tokens_computed for m in models],
            preemptions=[m.preemptions for m in models],
            window_s=window,
            requests_series=counts,
            tokens_series=work,
            decisions=dict(sorted(decisions.items())),
            events=events,
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
