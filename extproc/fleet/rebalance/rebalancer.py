"""The rebalancer: applies the planner's moves to the affinity store and pre-warms them.

It reacts to membership (a replica joined or left), to rotation (a replica was ejected), and to
heat (a replica above the hot thresholds for ``hot_for_s``, at most once per
``replica_cooldown_s``). It is never on the request path: the router only notes each session's
latest request in the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from extproc.base.validation import Section, option
from extproc.base.world import REAL_WORLD, World
from extproc.fleet.rebalance.ledger import SessionLedger
from extproc.fleet.rebalance.observer import RebalanceObserver
from extproc.fleet.rebalance.planner import Move, plan_join, plan_leave, plan_shed
from extproc.fleet.rebalance.prewarm import Prewarmer, PrewarmSettings
from extproc.routing.model import Snapshot
from extproc.routing.ring import HashRing
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.fleet.rebalance")


class RebalanceSettings(Section):
    """``rebalance:``: moving sessions when replicas leave, join or run hot."""

    enabled: bool = option(True, "rebalance at all")
    # Off by default: in the simulator (benchmarks/scaling.md) moving a newcomer's ring share of live
    # sessions at once cost more TTFT p99 (cold prefills, pre-warms landing together on the new
    # replicas) than it won back; new sessions fill a newcomer through the load scorer instead.
    move_on_join: bool = option(False, "move a newcomer's ring share of live sessions to it")
    session_cooldown_s: float = option(300.0, "a moved session is not moved again sooner", ge=0)
    hot_kv: float = option(0.85, "KV usage over which a replica is hot", ge=0, le=1)
    hot_queue: int = option(16, "queue over which a replica is hot", ge=0)
    hot_for_s: float = option(10.0, "hot this long before it sheds sessions", ge=0)
    shed_fraction: float = option(0.1, "share of a hot replica's sessions moved", ge=0, le=1)
    replica_cooldown_s: float = option(60.0, "a replica sheds at most this often", ge=0)
    ledger_sessions: int = option(10_000, "sessions whose last request is kept for moves", ge=1)
    ledger_bytes: int = option(64 * 1024 * 1024, "bytes of kept requests at most", ge=1)
    prewarm: PrewarmSettings = option(PrewarmSettings(), "warming a moved session's new replica")


class Rebalancer:
    """Moves sessions between replicas when the fleet changes."""

    def __init__(
        self,
        settings: RebalanceSettings,
        store: AffinityStore,
        clock: Callable[[], float],
        metrics: RebalanceObserver,
        prewarmer: Prewarmer | None = None,
        session_ttl_s: float = 600.0,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.ledger = SessionLedger(settings.ledger_sessions, settings.ledger_bytes, session_ttl_s)
        self.prewarmer = prewarmer or Prewarmer(settings.prewarm, clock, on_result=metrics.prewarmed, world=world)
        self._hot_since: dict[str, float] = {}
        self._last_shed: dict[str, float] = {}

    def note(
        self, session: str, model: str, replica: str, path: str, body: bytes, now: float, hashes: Sequence[int] = ()
    ) -> None:
        """A session's latest request went to ``replica``; ``hashes``: its prefix keys as looked
        up (kept, not computed again, so a move indexes it in the live key space)."""
        if self.settings.enabled:
            self.ledger.note(session, model, replica, path, body, now, hashes)

    async def apply(self, moves: Sequence[Move], snapshot: Snapshot, now: float) -> int:
        """Re-pin, re-index and pre-warm each move; returns how many were applied."""
        applied = 0
        for move in moves:
            target = snapshot.get(move.target)
            if target is None:
                continue
            try:
                await self.store.record(move.session, move.target, move.hashes, now, True, model=move.model)
            except Exception as exc:
                self.metrics.repin_failed()
                log.debug("re-pinning a moved session failed: %s", exc)
                continue
            self.ledger.moved(move.session, move.model, move.target, now)
            self.metrics.session_moved(move.reason)
            self.prewarmer.submit(target.replica.address, move.path, move.body)
            applied += 1
        if applied:
            log.info("moved %d sessions (%s)", applied, moves[0].reason)
        return applied

    async def on_join(self, name: str, ring: HashRing, snapshot: Snapshot) -> int:
        """A replica joined: its ring share of live sessions moves to it (with ``move_on_join``)."""
        if not self.settings.enabled or not self.settings.move_on_join:
            return 0
        now = self.clock()
        moves = plan_join(name, self.ledger.live(now), ring, now, self.settings.session_cooldown_s)
        return await self.apply(moves, snapshot, now)

    async def on_leave(self, name: str, ring: HashRing, snapshot: Snapshot) -> int:
        """A replica left or was ejected: its sessions move to their next ring replica."""
        if not self.settings.enabled:
            return 0
        now = self.clock()
        moves = plan_leave(name, self.ledger.live(now), ring, snapshot.replicas)
        return await self.apply(moves, snapshot, now)

    async def check_hot(self, snapshot: Snapshot) -> int:
        """Shed sessions from replicas that have been hot for ``hot_for_s``."""
        if not self.settings.enabled:
            return 0
        now = self.clock()
        s = self.settings
        applied = 0
        for state in snapshot.replicas:
            hot = state.in_rotation and (state.kv_usage > s.hot_kv or state.queue > s.hot_queue)
            if not hot:
                self._hot_since.pop(state.name, None)
                continue
            since = self._hot_since.setdefault(state.name, now)
            cooled = now - self._last_shed.get(state.name, float("-inf")) >= s.replica_cooldown_s
            if now - since >= s.hot_for_s and cooled:
                self._last_shed[state.name] = now
                moves = plan_shed(
                    state.name, self.ledger.live(now), snapshot.replicas, s.shed_fraction, now, s.session_cooldown_s
                )
                applied += await self.apply(moves, snapshot, now)
        return applied

    async def close(self) -> None:
        """Stop pre-warming."""
        await self.prewarmer.close()
