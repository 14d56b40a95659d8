"""The rebalancer: applies the planner's moves to the affinity store and pre-warms them.

It reacts to membership (a replica joined or left), to rotation (a replica was ejected), and to
heat (a replica above the hot thresholds for ``hot_for_s``, at most once per
``replica_cooldown_s``). It is never on the request path: the router only notes each session's
latest request in the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.rebalance.ledger import SessionLedger
from extproc.rebalance.observer import RebalanceObserver
from extproc.rebalance.planner import Move, plan_join, plan_leave, plan_shed
from extproc.rebalance.prewarm import Prewarmer, PrewarmSettings
from extproc.routing.model import Snapshot
from extproc.routing.ring import HashRing
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.rebalance")


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    """Config ``rebalance:``."""

    enabled: bool = True
    # Off by default: in the simulator (benchmarks/scaling.md) moving a newcomer's ring share of live
    # sessions at once cost more TTFT p99 (cold prefills, pre-warms landing together on the new
    # replicas) than it won back; new sessions fill a newcomer through the load scorer instead.
    move_on_join: bool = False
    session_cooldown_s: float = 300.0
    hot_kv: float = 0.85
    hot_queue: int = 16
    hot_for_s: float = 10.0
    shed_fraction: float = 0.1
    replica_cooldown_s: float = 60.0
    ledger_sessions: int = 10_000
    ledger_bytes: int = 64 * 1024 * 1024
    prewarm: PrewarmSettings = field(default_factory=PrewarmSettings)


IndexHashes = Callable[[str, bytes], Sequence[int]]


class Rebalancer:
    """Moves sessions between replicas when the fleet changes."""

    def __init__(
        self,
        settings: RebalanceSettings,
        store: AffinityStore,
        clock: Callable[[], float],
        metrics: RebalanceObserver,
        index_hashes: IndexHashes,
        prewarmer: Prewarmer | None = None,
        session_ttl_s: float = 600.0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.index_hashes = index_hashes
        self.ledger = SessionLedger(settings.ledger_sessions, settings.ledger_bytes, session_ttl_s)
        self.prewarmer = prewarmer or Prewarmer(settings.prewarm, clock, on_result=metrics.prewarmed)
        self._hot_since: dict[str, float] = {}
        self._last_shed: dict[str, float] = {}

    def note(self, session: str, model: str, replica: str, path: str, body: bytes, now: float) -> None:
        """A session's latest request went to ``replica``."""
        if self.settings.enabled:
            self.ledger.note(session, model, replica, path, body, now)

    async def apply(self, moves: Sequence[Move], snapshot: Snapshot, now: float) -> int:
        """Re-pin, re-index and pre-warm each move; returns how many were applied."""
        applied = 0
        for move in moves:
            target = snapshot.get(move.target)
            if target is None:
                continue
            try:
                hashes = self.index_hashes(move.path, move.body)
                await self.store.record(move.session, move.target, hashes, now, True, model=move.model)
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
