"""The simulator with priority queueing: interactive and batch requests over a full fleet.

:class:`PrioritySimulation` replays an open-loop workload like
:class:`~extproc_lab.sim.simulator.Simulation` (replica models on a virtual clock, the router's
request core, its outcomes and ``release``, scrapes into the replica book) and, with
``config.queueing.enabled``, holds requests as the ext_proc server does: a request goes on when
nothing of its priority or above waits and its candidates are not all saturated
(:meth:`Router.fleet_saturated`, the server's test), else it waits. The decisions are the
server's own (:class:`~extproc.queueing.Admission`, on the virtual clock): release order
(priority, then round robin by tenant), one at a time whenever the head's candidates have
headroom (looked at after a scrape and after a request ends), and refusal of a request arriving
at a full queue or of every request held past its class's ``max_wait_s``, counted. Without
queueing every request goes to a replica at once (its own vLLM queue holds it), which is what
the queue is compared with.

A request every candidate is predicted to miss goes as its class's ``on_miss`` says, as in the
server: shed (refused, counted as ``objective``), held in the same queue until a decision would
meet its objectives or the fleet is idle (:meth:`Router.objective_ready`; ``objective_timeout``
past its limit), or routed best effort.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from extproc.config import Config
from extproc.health.replicas import LoadReport
from extproc.queueing import Admission, Refusal
from extproc.request.features import RequestFeatures
from extproc.router import Routed
from extproc.routing.pipeline import Profile
from extproc_lab.replica.model import Seq, StepResult
from extproc_lab.replica.timing import ReplicaProfile
from extproc_lab.sim.simulator import Simulation
from extproc_lab.sim.workload import SimRequest, Workload


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
    refusals: dict[int, str] = field(default_factory=dict)
    """Request index -> why it was refused (full, timeout, objective, objective_timeout)."""


class PrioritySimulation(Simulation):
    """An open-loop workload on ``replicas`` models of ``profile``, routed by ``routing`` (None:
    the config's profile) under ``config`` (its ``queueing`` section decides whether requests are held);
    ``request_class(req)`` names each request's class, as the config's ``classes:`` would.

    The one event loop of :class:`~extproc_lab.sim.simulator.Simulation`, with admission as its
    hooks: an arrival may be held instead of routed, the queue is looked at after each scrape,
    after a step in which requests ended, and at a tick of its own (after the steps ending then)
    when something waits. Replicas report their load as a scraper without the prefix counters
    would (:meth:`~extproc.health.replicas.ReplicaBook.apply_report`; no health evaluation).
    """

    TICK = 2

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
        super().__init__(workload, profile, replicas, lambda probe: routing, config=config, max_run_steps=max_run_steps)
        self.request_class = request_class
        self.interval = self.scrape_interval_s

    def run(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> PriorityRun:  # type: ignore[override]
        """Replay the workload to its end."""
        self._held: Admission[int] = Admission(self.config.queueing, self.router.fleet_saturated, self.clock)
        self._features: dict[int, RequestFeatures] = {}
        self._dispatched_at: dict[int, float] = {}
        self._out = PriorityRun([])
        self._tick_pending = False
        self._objective_held: set[int] = set()
        self._pumping = False
        self._loop(on_progress, progress_every)
        held = self._held
        if len(held):
            raise RuntimeError(f"{len(held)} requests still held")
        out = self._out
        out.served.sort(key=lambda s: s.index)
        return out

    # --- hooks of the event loop ---------------------------------------------------------------

    def _scrape(self, at: float, now: float) -> None:
        book = self.router.replicas
        for name, model in zip(self.names, self.models, strict=True):
            book.apply_report(name, LoadReport(model.num_waiting, model.num_running, model.kv_cache_usage_perc), at)
        if len(self._held):
            self._pump(now)

    def _arrive(self, i: int, now: float) -> None:
        req = self.workload.requests[i]
        cls = self.request_class(req)
        out = self._out
        out.classes[i] = cls
        f = replace(req.features(self.config.features, self.objectives), request_class=cls)
        if not self.config.queueing.enabled:
            self._dispatch(i, f, now)
            return
        self._expire()
        held = self._held.admit(cls, f.tenant, f.pool, i)
        if held is None:
            self._dispatch(i, f, now, may_wait=True)
        elif isinstance(held, Refusal):
            self._refuse(i, "full")
        else:
            self._features[i] = f
            out.max_waiting = max(out.max_waiting, len(self._held))
            self._pump(now)

    def _decided(self, i: int, features: RequestFeatures, routed: Routed, now: float) -> None:
        # The replica sees the request when it was dispatched; its wait in our queue is added back.
        self._dispatched_at[i] = now

    def _refused(self, i: int, routed: Routed, now: float) -> None:
        self._dispatched_at.pop(i, None)
        if routed.objective_wait is not None:
            f = routed.features
            ready = self.router.core.objective_ready(f, routed.objective_wait)
            held = self._held.admit(self._out.classes[i], f.tenant, f.pool, i, ready)
            if isinstance(held, Refusal):
                self._refuse(i, "full")
            elif held is not None:
                self._features[i] = f
                self._objective_held.add(i)
                self._out.max_waiting = max(self._out.max_waiting, len(self._held))
                self._pump(now)
            return
        self._refuse(i, routed.refusal.kind if routed.refusal is not None else "no_replica")

    def _finished(self, i: int, seq: Seq) -> None:
        req = self.workload.requests[i]
        self._out.served.append(
            Served(
                i,
                self._out.classes[i],
                req.tenant,
                req.arrival_s,
                self._dispatched_at.pop(i),
                seq.first_token_at,
                seq.finished_at,
                seq.generated,
            )
        )

    def _after_step(self, result: StepResult, now: float) -> None:
        if result.finished and len(self._held):
            self._pump(now)

    def _on_event(self, kind: int, a: int, now: float) -> None:
        if kind != self.TICK:
            super()._on_event(kind, a, now)
        self._tick_pending = False
        self._pump(now)

    # --- the queue -----------------------------------------------------------------------------

    def _refuse(self, i: int, why: str) -> None:
        self._features.pop(i, None)
        self._objective_held.discard(i)
        self._out.refused[why] = self._out.refused.get(why, 0) + 1
        self._out.refusals[i] = why

    def _expire(self) -> None:
        # Every waiter past its limit, wherever it is in the queue: as the server's timers would
        # have refused it by now (nothing looks at the queue between events).
        for waiter, refusal in self._held.expire():
            self._refuse(waiter.item, "timeout" if refusal.kind == "queue_timeout" else refusal.kind)

    def _pump(self, now: float) -> None:
        """Refuse the expired; release the head of the queue while its candidates have headroom."""
        if self._pumping:  # a request released here came back to be held: this loop goes on
            return
        self._expire()
        held = self._held
        self._pumping = True
        try:
            while (waiter := held.next_to_go()) is not None:
                i = waiter.item
                # Held for its objectives: decided once more and sent wherever that says. Held for
                # saturation: judged on its objectives now, for the first time.
                objective = i in self._objective_held
                self._objective_held.discard(i)
                self._dispatch(i, self._features.pop(i), now, may_wait=not objective)
        finally:
            self._pumping = False
        if len(held) and not self._tick_pending:
            self._tick_pending = True  # look again at the next scrape even if nothing ends before
            self._push((int(now // self.interval) + 1) * self.interval, self.TICK, 0)
