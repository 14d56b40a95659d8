"""The simulator with a changing fleet, pre-warming and refused requests.

:class:`DynamicSimulation` replays a workload like :class:`~extproc_lab.sim.simulator.Simulation`
(the same event loop, the same router entry points) and adds what the scaling and tenant
experiments need:

- **membership events** at given virtual times: ``(at_s, replica_count)`` makes replicas
  ``replica-0 .. replica-{count-1}`` the membership through :meth:`Router.set_replicas` (joins
  take their ring share of live sessions, leaves move theirs); new names get new replica models,
  models that left drain what they already hold and take nothing new;
- **the session ledger**: each routed session request is noted in the rebalancer's ledger with
  its OpenAI body, as :meth:`Router.route` does (the simulator calls ``route_features``);
- **pre-warming**: the rebalancer's prewarmer is a :class:`SimPrewarmer`, the real
  :class:`~extproc.rebalance.prewarm.Prewarmer` (its token bucket, queue and
  ``prefill_only`` body) pumped by the virtual clock instead of asyncio; its ``send`` turns the
  pre-warm body into a prefill-only request (``max_tokens`` 1) on the target replica model;
- **refusals**: a request the router refuses (no replica, reason ``quota``) is dropped and
  counted (closed-loop follow-ups of a refused request are dropped with it).
"""

from __future__ import annotations

import functools
import heapq
import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from extproc.rebalance.prewarm import Prewarmer, PrewarmSettings
from extproc.request.openai_body import render_chat
from extproc.request.prefix import block_hashes, model_seed
from extproc.router import Routed
from extproc.routing.model import Replica
from extproc_lab.replica.cache import count_tokens
from extproc_lab.replica.model import ReplicaModel, Seq
from extproc_lab.sim.simulator import Outcome, RouteTally, SimRun, Simulation, run_sync, scrape
from extproc_lab.sim.workload import BLOCK_TOKENS, DEFAULT_MODEL, SimRequest
from extproc_lab.stats import percentile

_CONTROL, _ARRIVAL, _STEP_END, _PUMP = -1, 0, 1, 2


class SimPrewarmer(Prewarmer):
    """The real prewarmer with its background task replaced by virtual-clock pumping: the
    simulation calls :meth:`pump` at the time :meth:`submit` or the token bucket asks for."""

    def __init__(
        self,
        settings: PrewarmSettings,
        clock: Callable[[], float],
        send: Callable[[str, str, bytes, float], Any],
        wake: Callable[[float], None],
    ) -> None:
        super().__init__(settings, clock, send)
        self.wake_at = wake
        self.results: dict[str, int] = {}
        self.on_result = lambda outcome: self.results.__setitem__(outcome, self.results.get(outcome, 0) + 1)

    def _start(self) -> None:
        """Instead of a background task: ask the simulation to pump now."""
        self.wake_at(self.clock())

    def pump(self) -> None:
        """Send what the token bucket allows now; ask to be woken when the next token is due."""
        while self._pending:
            wait = self._take_token()
            if wait > 0:
                # Not sooner than a microsecond: float rounding could otherwise wake it at now.
                self.wake_at(self.clock() + max(wait, 1e-6))
                return
            address, path, body = self._pending.popleft()
            status: int = run_sync(
                cast("Coroutine[Any, Any, int]", self.send(address, path, body, self.settings.timeout_s))
            )
            self.on_result("ok" if status < 400 else "error")


@dataclass
class Change:
    """One membership change and what it did."""

    at_s: float
    replicas_before: int
    replicas_after: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    live_sessions: int
    moved: int
    moved_sessions: frozenset[str] = field(default_factory=frozenset)

    @property
    def moved_share(self) -> float:
        """Moved sessions over live sessions (the ledger's) at the change."""
        return self.moved / self.live_sessions if self.live_sessions else 0.0


@dataclass
class DynamicRun:
    """A :class:`SimRun` plus the changes, pre-warms and refusals."""

    run: SimRun
    changes: list[Change]
    prewarms_sent: int
    prewarm_results: dict[str, int]
    refused: dict[str, int]
    session_keys: dict[int, str]
    """request index -> the router's session key (tenant-scoped), for sessions only."""
    tenants: dict[int, str]


def _body_bytes(req: SimRequest) -> bytes:
    return json.dumps(req.body(), separators=(",", ":")).encode()


def _warm_seq(body: bytes, handle: int) -> Seq:
    """The replica-side request of a pre-warm body: its prompt keyed as the text workloads are."""
    request = json.loads(body)
    model = str(request.get("model") or DEFAULT_MODEL)
    text = render_chat(request["messages"])[0] if "messages" in request else str(request.get("prompt", ""))
    keys = block_hashes(text, model_seed(model), BLOCK_TOKENS * 4, 1 << 30)
    return Seq(f"warm{handle}", count_tokens(text), max(1, int(request.get("max_tokens", 1))), keys, handle=handle)


class DynamicSimulation(Simulation):
    """A :class:`Simulation` whose fleet changes at ``changes`` (``(at_s, replica_count)``)."""

    def __init__(self, *args: Any, changes: Sequence[tuple[float, int]] = (), **kwargs: Any) -> None:
        self._wakes: list[float] = []
        super().__init__(*args, **kwargs)
        self.changes = sorted(changes)
        self.replica_profile = self.models[0].profile
        self._warm_submit: Callable[[int, Seq], None] = lambda m, seq: None
        self.prewarms_sent = 0

    def _prewarmer(self) -> Prewarmer:
        """Pre-warms delivered to the replica models on the virtual clock."""
        return SimPrewarmer(self.config.rebalance.prewarm, self.clock, self._send, self._wakes.append)

    async def _send(self, address: str, path: str, body: bytes, timeout_s: float) -> int:
        index = int(address.rsplit(":", 1)[1])
        if index >= len(self.models):
            return 503
        self.prewarms_sent += 1
        self._warm_submit(index, _warm_seq(body, -self.prewarms_sent))
        return 200

    def run(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> SimRun:
        """Replay the workload to its end (the plain run, for :class:`Simulation`'s callers)."""
        return self.run_dynamic().run

    def run_dynamic(self) -> DynamicRun:
        """Replay the workload with the membership changes, pre-warms and refusals."""
        reqs = self.workload.requests
        followers = self.workload.followers()
        heap: list[tuple[float, int, int, int, int]] = []
        order = 0
        for r in reqs:
            if r.after < 0:
                heap.append((r.arrival_s, _ARRIVAL, order, r.index, 0))
                order += 1
        for c, (at, _) in enumerate(self.changes):
            heap.append((at, _CONTROL, order, c, 0))
            order += 1
        heapq.heapify(heap)
        models = self.models
        names = self.names
        n = len(models)
        version = [0] * n
        step_start = [0.0] * n
        scheduled_end = [0.0] * n
        counts: list[list[int]] = [[] for _ in range(n)]
        work: list[list[float]] = [[] for _ in range(n)]
        seqs: dict[int, Seq] = {}
        routed: dict[int, Routed] = {}
        replica_of: dict[int, int] = {}
        index_of = {name: i for i, name in enumerate(names)}
        window = self.window_s
        tally = RouteTally(window, counts)
        interval = self.scrape_interval_s
        last_tick = -1
        book = self.router.replicas
        settings = self.config.features
        clock = self.clock
        router = self.router
        rebalancer = router.rebalancer
        prewarmer = rebalancer.prewarmer
        assert isinstance(prewarmer, SimPrewarmer)
        outcomes: list[Outcome] = []
        decisions: dict[str, int] = {}
        refused: dict[str, int] = {}
        changes: list[Change] = []
        session_keys: dict[int, str] = {}
        tenants: dict[int, str] = {}
        members = len(book)
        events = 0
        warm_pending = 0

        def add_work(m: int, start: float, end: float, tokens: int) -> None:
            series = work[m]
            rate = tokens / (end - start) if end > start else 0.0
            while start < end:
                w = int(start // window)
                if (w + 1) * window <= start:
                    w += 1
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

        def submit(m: int, seq: Seq, now: float) -> None:
            nonlocal order
            model = models[m]
            if model.busy:
                end = model.cut(now)
                if end != scheduled_end[m]:
                    version[m] += 1
                    scheduled_end[m] = end
                    heapq.heappush(heap, (end, _STEP_END, order, m, version[m]))
                    order += 1
            model.submit(seq, now)
            if not model.busy:
                start_step(m, now)

        def warm(m: int, seq: Seq) -> None:
            nonlocal warm_pending
            warm_pending += 1
            submit(m, seq, clock.now)

        self._warm_submit = warm

        def schedule_wakes() -> None:
            nonlocal order
            for at in self._wakes:
                heapq.heappush(heap, (at, _PUMP, order, 0, 0))
                order += 1
            self._wakes.clear()

        def drop(i: int, now: float) -> None:
            # A refused request: its closed-loop follow-ups are never sent either.
            for f in followers.get(i, ()):
                refused["follow_up"] = refused.get("follow_up", 0) + 1
                drop(f, now)

        while heap:
            now, kind, _, a, b = heapq.heappop(heap)
            if kind == _STEP_END and version[a] != b:
                continue
            events += 1
            clock.now = now
            tick = int(now // interval)
            if tick > last_tick:
                last_tick = tick
                at = tick * interval
                for i, model in enumerate(models):
                    book.apply_scrape(names[i], scrape(model), at)
                if self._evaluate:
                    book.evaluate(at)
            if kind == _CONTROL:
                target = self.changes[a][1]
                while len(models) < target:
                    i = len(models)
                    name = f"replica-{i}"
                    names.append(name)
                    index_of[name] = i
                    models.append(ReplicaModel(self.replica_profile))
                    version.append(0)
                    step_start.append(0.0)
                    scheduled_end.append(0.0)
                    counts.append([])
                    work.append([])
                live = sum(1 for _ in rebalancer.ledger.live(now))
                wanted = [Replica(names[i], f"sim:{i}") for i in range(target)]
                membership = run_sync(router.set_replicas(wanted))
                moved = frozenset(e.session for e in rebalancer.ledger.live(now) if e.moved_at == now)
                changes.append(
                    Change(now, members, target, membership.joined, membership.left, live, len(moved), moved)
                )
                members = target
                schedule_wakes()
                continue
            if kind == _PUMP:
                prewarmer.pump()
                schedule_wakes()
                continue
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
                decision = run_sync(router.route_features(features, now))
                self.routing = None
                reason = decision.decision.reason.value
                decisions[reason] = decisions.get(reason, 0) + 1
                chosen = decision.decision.replica
                tenants[a] = req.tenant
                if chosen is None:
                    refused[reason] = refused.get(reason, 0) + 1
                    drop(a, now)
                    continue
                m = index_of[chosen.name]
                if features.session_key is not None:
                    session_keys[a] = features.session_key
                    if rebalancer.settings.enabled:
                        body = json.dumps(req.body(), separators=(",", ":")).encode()
                        rebalancer.note(features.session_key, features.model, chosen.name, features.path, body, now)
                if router.hot_keys is not None:  # a hot prefix's request, kept to warm joining replicas
                    router.offer_hot_body(features, functools.partial(_body_bytes, req))
                seqs[a] = seq
                routed[a] = decision
                replica_of[a] = m
                tally.routed(a, m, now, req.tenant, req.session)
                submit(m, seq, now)
                continue
            model = models[a]
            result = model.end_step()
            add_work(a, step_start[a], now, result.tokens)
            for seq in result.first:
                if seq.handle >= 0 and router.sample_response():
                    router.observe_response(routed[seq.handle], 200)
            for seq in result.finished:
                i = seq.handle
                if i < 0:
                    warm_pending -= 1
                    continue
                router.release(routed.pop(i))
                outcomes.append(tally.outcome(i, replica_of[i], seq, reqs[i].session))
                del seqs[i]
                for f in followers.get(i, ()):
                    heapq.heappush(heap, (now + reqs[f].arrival_s, _ARRIVAL, order, f, 0))
                    order += 1
            start_step(a, now)
        if seqs or warm_pending:
            raise RuntimeError(f"{len(seqs)} requests and {warm_pending} pre-warms never finished")
        outcomes.sort(key=lambda o: o.index)
        run = SimRun(
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
        return DynamicRun(run, changes, self.prewarms_sent, dict(prewarmer.results), refused, session_keys, tenants)


@dataclass(frozen=True)
class WindowFigures:
    """Requests arriving in a window: count, token hit ratio, TTFT p99 (seconds)."""

    requests: int
    hit_ratio: float
    ttft_p99_s: float


def window_figures(outcomes: Sequence[Outcome], start: float, end: float) -> WindowFigures:
    """Figures of the requests that arrived in ``[start, end)``."""
    chosen = [o for o in outcomes if start <= o.arrival < end]
    prompt = sum(o.prompt_tokens for o in chosen)
    cached = sum(o.cached_tokens for o in chosen)
    ttfts = [o.first_token - o.arrival for o in chosen]
    return WindowFigures(len(chosen), cached / prompt if prompt else 0.0, percentile(ttfts, 0.99))
