"""The simulator with priority queueing: interactive and batch requests over a full fleet.

:class:`PrioritySimulation` replays an open-loop workload like
:class:`~extproc_lab.sim.simulator.Simulation` (replica models on a virtual clock, the router's
``route_features``, ``observe_response`` and ``release``, scrapes into the replica book) and, with
``config.queueing.enabled``, holds requests as the ext_proc server does: a request goes on when
nothing of its priority or above waits and its candidates are not all saturated
(:meth:`Router.fleet_saturated`, the server's test), else it waits in the server's own release
order (:class:`~extproc.queueing.PriorityLevels`: priority, then round robin by tenant) and
leaves, one at a time, whenever the head's candidates have headroom: after a scrape and after a
request ends. A request held past its class's ``max_wait_s``, or arriving at a full queue, is
refused and counted. Without queueing every request goes to a replica at once (its own vLLM
queue holds it), which is what the queue is compared with.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from extproc.config import Config
from extproc.health.replicas import LoadReport
from extproc.queueing import PriorityLevels
from extproc.request.features import RequestFeatures
from extproc.router import Routed, Router
from extproc.routing.model import Replica
from extproc.routing.pipeline import Profile
from extproc.state.memory import MemoryStore
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.replica.timing import ReplicaProfile
from extproc_lab.sim.simulator import VirtualClock, run_sync
from extproc_lab.sim.workload import SimRequest, Workload

_ARRIVAL, _STEP_END, _TICK = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Served:
    """One request's fate."""

    index: int
    request_class: str
    tenant: str
    arrival: float
    dispatched: float
    first_token: float
    finish: float
    output_tokens: int


@dataclass
class PriorityRun:
    """What a run produced."""

    served: list[Served]
    refused: dict[str, int] = field(default_factory=dict)
    classes: dict[int, str] = field(default_factory=dict)
    max_waiting: int = 0


class PrioritySimulation:
    """An open-loop workload on ``replicas`` models of ``profile``, routed by ``routing`` (None:
    the config's profile) under ``config`` (its ``queueing`` section decides whether requests are held);
    ``request_class(req)`` names each request's class, as the config's ``classes:`` would."""

    def __init__(
        self,
        workload: Workload,
        profile: ReplicaProfile,
        replicas: int,
        routing: Profile | None,
        config: Config,
        request_class: Callable[[SimRequest], str],
        *,
        max_run_steps: int = 1 << 20,
    ) -> None:
        if any(r.after >= 0 for r in workload.requests):
            raise ValueError("the priority simulation replays open-loop workloads only")
        self.workload = workload
        self.names = [f"replica-{i}" for i in range(replicas)]
        members = tuple(Replica(n, f"sim:{i}") for i, n in enumerate(self.names))
        self.config = replace(config, replicas=members, metrics_listen=None)
        self.clock = VirtualClock()
        store = MemoryStore(self.config.session_ttl_s, self.config.max_sessions, self.config.blocks_per_replica)
        self.router = Router(self.config, store=store, clock=self.clock, profile=routing)
        self.models = [ReplicaModel(profile) for _ in range(replicas)]
        self.request_class = request_class
        self.interval = self.config.health.scrape_interval_s
        self.max_run_steps = max_run_steps

    def run(self) -> PriorityRun:
        """Replay the workload to its end."""
        reqs = self.workload.requests
        queueing = self.config.queueing
        held: PriorityLevels[int] = PriorityLevels()
        heap: list[tuple[float, int, int, int, int]] = [
            (r.arrival_s, _ARRIVAL, i, r.index, 0) for i, r in enumerate(reqs)
        ]
        heapq.heapify(heap)
        order = len(heap)
        models, names, router, clock = self.models, self.names, self.router, self.clock
        index_of = {n: i for i, n in enumerate(names)}
        version = [0] * len(models)
        scheduled_end = [0.0] * len(models)
        features: dict[int, RequestFeatures] = {}
        routed: dict[int, Routed] = {}
        dispatched_at: dict[int, float] = {}
        replica_of: dict[int, int] = {}
        out = PriorityRun([])
        last_tick = -1
        tick_pending = False
        settings = self.config.features

        def push(at: float, kind: int, a: int, b: int = 0) -> None:
            nonlocal order
            heapq.heappush(heap, (at, kind, order, a, b))
            order += 1

        def start_step(m: int, now: float) -> None:
            duration = models[m].begin_step(now, self.max_run_steps)
            if duration is None:
                return
            version[m] += 1
            scheduled_end[m] = now + duration
            push(now + duration, _STEP_END, m, version[m])

        def dispatch(i: int, now: float) -> None:
            req = reqs[i]
            decision = run_sync(router.route_features(features.pop(i), now))
            chosen = decision.decision.replica
            if chosen is None:
                raise RuntimeError("the router chose no replica")
            m = index_of[chosen.name]
            routed[i], replica_of[i], dispatched_at[i] = decision, m, now
            seq = Seq(req.request_id, req.prompt_tokens, req.output_tokens, req.keys, req.key_span, req.tail_span)
            seq.handle = i
            model = models[m]
            if model.busy:
                end = model.cut(now)
                if end != scheduled_end[m]:
                    version[m] += 1
                    scheduled_end[m] = end
                    push(end, _STEP_END, m, version[m])
            # The replica sees the request when it was dispatched; its wait in our queue is added back below.
            model.submit(seq, now)
            if not model.busy:
                start_step(m, now)

        def refuse(i: int, why: str) -> None:
            features.pop(i, None)
            out.refused[why] = out.refused.get(why, 0) + 1

        def pump(now: float) -> None:
            nonlocal tick_pending
            while len(held):
                i = held.head()
                assert i is not None
                f = features[i]
                terms = queueing.for_class(f.request_class)
                if now - reqs[i].arrival_s > terms.max_wait_s:
                    held.pop()
                    refuse(i, "timeout")
                    continue
                if router.fleet_saturated(f.pool):
                    break
                held.pop()
                dispatch(i, now)
            if len(held) and not tick_pending:
                tick_pending = True  # look again at the next scrape even if nothing ends before
                push((int(now // self.interval) + 1) * self.interval, _TICK, 0)

        while heap:
            now, kind, _, a, b = heapq.heappop(heap)
            if kind == _STEP_END and version[a] != b:
                continue
            clock.now = now
            tick = int(now // self.interval)
            if tick > last_tick:
                last_tick = tick
                at = tick * self.interval
                for i, model in enumerate(models):
                    report = LoadReport(model.num_waiting, model.num_running, model.kv_cache_usage_perc)
                    router.replicas.apply_report(names[i], report, at)
                if len(held):
                    pump(now)
            if kind == _TICK:
                tick_pending = False
                pump(now)
                continue
            if kind == _ARRIVAL:
                req = reqs[a]
                cls = self.request_class(req)
                out.classes[a] = cls
                f = replace(req.features(settings), request_class=cls)
                features[a] = f
                if not queueing.enabled:
                    dispatch(a, now)
                    continue
                terms = queueing.for_class(cls)
                if not held.ahead(terms.priority) and not router.fleet_saturated(f.pool):
                    dispatch(a, now)
                elif held.waiting(terms.priority) >= terms.max_queued:
                    refuse(a, "full")
                else:
                    held.push(terms.priority, f.tenant, a)
                    out.max_waiting = max(out.max_waiting, len(held))
                    pump(now)
                continue
            model = models[a]
            result = model.end_step()
            for seq in result.first:
                router.observe_response(routed[seq.handle], 200)
            for seq in result.finished:
                i = seq.handle
                router.release(routed.pop(i))
                req = reqs[i]
                out.served.append(
                    Served(
                        i,
                        out.classes[i],
                        req.tenant,
                        req.arrival_s,
                        dispatched_at.pop(i),
                        seq.first_token_at,
                        seq.finished_at,
                        seq.generated,
                    )
                )
            start_step(a, now)
            if result.finished and len(held):
                pump(now)
        if routed or len(held):
            raise RuntimeError(f"{len(routed)} requests never finished, {len(held)} still held")
        out.served.sort(key=lambda s: s.index)
        return out
