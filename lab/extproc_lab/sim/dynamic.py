"""The simulator with a changing fleet, pre-warming and refused requests.

:class:`DynamicSimulation` replays a workload like :class:`~extproc_lab.sim.simulator.Simulation`
(the same event loop, the same router entry points) and adds what the scaling and tenant
experiments need:

- **membership events** at given virtual times: ``(at_s, replica_count)`` makes replicas
  ``replica-0 .. replica-{count-1}`` the membership through the driver's ``set_replicas`` (joins
  take their ring share of live sessions, leaves move theirs); new names get new replica models,
  models that left drain what they already hold and take nothing new;
- **the session ledger**: each routed session request is noted in the rebalancer's ledger with
  its OpenAI body (the driver's ``note_session``), as the router's own entry point does;
- **pre-warming**: the rebalancer's prewarmer is the real
  :class:`~extproc.api.sim.Prewarmer` (its token bucket, queue and ``prefill_only``
  body) driven by a :class:`SimPrewarmer` on the virtual clock instead of asyncio, which sends
  each pre-warm body as a prefill-only request (``max_tokens`` 1) on the target replica model;
- **refusals**: a request the router refuses (no replica, reason ``quota``) is dropped and
  counted (closed-loop follow-ups of a refused request are dropped with it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.api import PrewarmSettings, Replica, RequestFeatures, Routed, render_chat
from extproc.api.sim import Prewarmer, block_hashes, model_seed
from extproc_lab.replica.cache import count_tokens
from extproc_lab.replica.model import Seq
from extproc_lab.sim.simulator import Outcome, SimRun, Simulation
from extproc_lab.sim.workload import BLOCK_TOKENS, DEFAULT_MODEL, SimRequest
from extproc_lab.stats import percentile


class SimPrewarmer:
    """The router's pre-warmer driven by the virtual clock instead of asyncio: its queue
    (:class:`~extproc.fleet.rebalance.prewarm.PrewarmQueue`) asks for a pump now whenever a pre-warm
    is queued, and :meth:`pump` sends, through ``send(address, path, body) -> status``, what the
    token bucket lets go, then asks to be woken when the next token is due."""

    def __init__(
        self,
        settings: PrewarmSettings,
        clock: Callable[[], float],
        send: Callable[[str, str, bytes], int],
        wake: Callable[[float], None],
    ) -> None:
        self.clock = clock
        self.send = send
        self.wake_at = wake
        self.results: dict[str, int] = {}
        self.prewarmer = Prewarmer(settings, clock, on_result=self._count, schedule=lambda: wake(clock()))

    def _count(self, outcome: str) -> None:
        self.results[outcome] = self.results.get(outcome, 0) + 1

    def pump(self) -> None:
        """Send what the token bucket allows now; ask to be woken when the next token is due."""
        queue = self.prewarmer.queue
        while (warm := queue.take()) is not None:
            if isinstance(warm, float):
                # Not sooner than a microsecond: float rounding could otherwise wake it at now.
                self.wake_at(self.clock() + max(warm, 1e-6))
                return
            queue.sent(self.send(warm.address, warm.path, warm.body))


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
    """A :class:`Simulation` whose fleet changes at ``changes`` (``(at_s, replica_count)``).

    It extends the one event loop through its hooks: the changes are events of their own kind
    (before an arrival at the same time), as are the pre-warmer's wake-ups (after the steps
    ending then); a refused request is counted and dropped with its follow-ups.
    """

    CONTROL, PUMP = -1, 2

    def __init__(self, *args: Any, changes: Sequence[tuple[float, int]] = (), **kwargs: Any) -> None:
        self._wakes: list[float] = []
        super().__init__(*args, **kwargs)
        self.changes = sorted(changes)
        self.prewarms_sent = 0

    def _prewarmer(self) -> Prewarmer:
        """Pre-warms delivered to the replica models on the virtual clock."""
        self._prewarms = SimPrewarmer(self.config.rebalance.prewarm, self.clock, self._send, self._wakes.append)
        return self._prewarms.prewarmer

    def _send(self, address: str, path: str, body: bytes) -> int:
        index = int(address.rsplit(":", 1)[1])
        if index >= len(self.models):
            return 503
        self.prewarms_sent += 1
        self._submit_side(index, _warm_seq(body, -self.prewarms_sent))
        return 200

    def run(self, on_progress: Callable[[int], None] | None = None, progress_every: int = 200) -> SimRun:
        """Replay the workload to its end (the plain run, for :class:`Simulation`'s callers)."""
        return self.run_dynamic().run

    def run_dynamic(self) -> DynamicRun:
        """Replay the workload with the membership changes, pre-warms and refusals."""
        self._refused_counts: dict[str, int] = {}
        self._changes_made: list[Change] = []
        self._session_keys: dict[int, str] = {}
        self._tenants: dict[int, str] = {}
        self._members = self.driver.replica_count()
        self._followers = self.workload.followers()
        self._loop()
        return DynamicRun(
            self._sim_run(),
            self._changes_made,
            self.prewarms_sent,
            dict(self._prewarms.results),
            self._refused_counts,
            self._session_keys,
            self._tenants,
        )

    # --- hooks of the event loop ---------------------------------------------------------------

    def _initial_events(self) -> list[tuple[float, int, int]]:
        return [(at, self.CONTROL, c) for c, (at, _) in enumerate(self.changes)]

    def _decided(self, i: int, features: RequestFeatures, routed: Routed, now: float) -> None:
        req = self.workload.requests[i]
        self._tenants[i] = req.tenant
        chosen = routed.decision.replica
        if chosen is None:
            return
        body = functools.partial(_body_bytes, req)
        self.driver.offer_hot_body(features, body)  # a hot prefix's request, kept to warm joining replicas
        if features.session_key is None:
            return
        self._session_keys[i] = features.session_key
        self.driver.note_session(features, chosen.name, body, now)

    def _refused(self, i: int, routed: Routed, now: float) -> None:
        reason = routed.decision.reason.value
        self._refused_counts[reason] = self._refused_counts.get(reason, 0) + 1
        self._drop(i)

    def _drop(self, i: int) -> None:
        # A refused request: its closed-loop follow-ups are never sent either.
        for f in self._followers.get(i, ()):
            self._refused_counts["follow_up"] = self._refused_counts.get("follow_up", 0) + 1
            self._drop(f)

    def _on_event(self, kind: int, a: int, now: float) -> None:
        if kind == self.CONTROL:
            self._change(self.changes[a][1], now)
        elif kind == self.PUMP:
            self._prewarms.pump()
        else:
            super()._on_event(kind, a, now)
        for at in self._wakes:
            self._push(at, self.PUMP, 0)
        self._wakes.clear()

    def _change(self, target: int, now: float) -> None:
        """Make ``replica-0 .. replica-{target-1}`` the membership."""
        while len(self.models) < target:
            self._add_replica()
        live = self.driver.live_sessions(now)
        wanted = [Replica(self.names[i], f"sim:{i}") for i in range(target)]
        membership = self.driver.set_replicas(wanted)
        moved = self.driver.sessions_moved_at(now)
        self._changes_made.append(
            Change(now, self._members, target, membership.joined, membership.left, live, len(moved), moved)
        )
        self._members = target


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
