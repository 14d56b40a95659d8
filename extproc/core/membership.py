"""The fleet as the router knows it: who is in it, who is cordoned or drained, and what moves when
that changes (sessions to their next ring replica, pre-warmed; hot prefixes to a joining replica)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.fleet.cache import ReplicaCaches
from extproc.fleet.health.replicas import ReplicaBook, Transition
from extproc.fleet.queueing import FairQueue
from extproc.fleet.rebalance.rebalancer import Rebalancer
from extproc.observe.hotkeys.warming import HotKeyWarmer
from extproc.routing.model import Replica, Snapshot
from extproc.routing.profile import Profile
from extproc.state.store import AffinityStore

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.fleet.kvevents.cache_state import EventCacheState

log = logging.getLogger("extproc.app.router")


@dataclass(frozen=True, slots=True)
class Membership:
    """What a membership update changed."""

    joined: tuple[str, ...]
    left: tuple[str, ...]


class FleetControl:
    """Membership, cordons and drains, and the moves they cause.

    ``profile`` gives the default profile (its ring decides where a leaving replica's sessions
    go); ``store_error`` counts a store operation that failed (the store is an optimisation: a
    failure there never stops a membership change).
    """

    def __init__(
        self,
        book: ReplicaBook,
        store: AffinityStore,
        caches: ReplicaCaches,
        rebalancer: Rebalancer,
        clock: Callable[[], float],
        profile: Callable[[], Profile],
        store_error: Callable[[str], None],
        *,
        queue: FairQueue | None = None,
        warmer: HotKeyWarmer | None = None,
        kv_events: EventCacheState | None = None,
    ) -> None:
        self.book = book
        self.store = store
        self.caches = caches
        self.rebalancer = rebalancer
        self.clock = clock
        self.profile = profile
        self.store_error = store_error
        self.queue = queue
        self.warmer = warmer
        self.kv_events = kv_events
        self.cordons: dict[str, str] = {}
        """The store's cordons as last read (:meth:`refresh_cordons`): the decision's input."""

    async def set_replicas(self, replicas: Sequence[Replica]) -> Membership:
        """Make ``replicas`` the membership (from discovery or a reload): new names join and take
        their ring share of live sessions (pre-warmed), missing names leave and their sessions move
        to their next ring replica, known names take the new address and weight."""
        wanted = {r.name: r for r in replicas}
        joined = [r.name for r in replicas if self.book.join(r)]
        left = [rec.replica.name for rec in self.book.records() if rec.replica.name not in wanted]
        now = self.clock()
        for name in left:
            snapshot = self.book.snapshot(now)
            await self.rebalancer.on_leave(name, self.profile().ring_for(snapshot), snapshot)
            self.book.leave(name)
            self.caches.forget(name)
            try:
                await self.store.forget_replica(name)
            except Exception as exc:
                self.store_error("forget")
                log.debug("store forget failed: %s", exc)
        snapshot = self.book.snapshot(now)
        for name in joined:
            await self.rebalancer.on_join(name, self.profile().ring_for(snapshot), snapshot)
            if self.warmer is not None:
                self.warmer.joined(name)
        if self.kv_events is not None:
            self.kv_events.sync([rec.replica for rec in self.book.records()])
        if joined or left:
            log.info("membership: joined %s, left %s", joined or "-", left or "-")
        return Membership(tuple(joined), tuple(left))

    async def refresh_cordons(self) -> dict[str, str]:
        """Read the cordons from the store (every gateway's, with Redis). A replica newly drained
        elsewhere has the sessions this gateway knows moved off it here too."""
        try:
            found = await self.store.cordons()
        except Exception as exc:
            self.store_error("lookup")
            log.debug("reading cordons failed: %s", exc)
            return self.cordons
        newly_drained = [n for n, s in found.items() if s == "drained" and self.cordons.get(n) != "drained"]
        self.cordons = found
        for name in newly_drained:
            await self.move_sessions_off(name)
        return found

    async def set_cordon(self, name: str, state: str | None) -> int:
        """Cordon (``"cordoned"``), drain (``"drained"``) or release (None) replica ``name`` for
        every gateway of the store; returns how many sessions a drain moved from this gateway."""
        await self.store.set_cordon(name, state)
        drained = state == "drained" and self.cordons.get(name) != "drained"
        cordons = dict(self.cordons)
        if state is None:
            cordons.pop(name, None)
        else:
            cordons[name] = state
        self.cordons = cordons
        log.info("replica %s: %s", name, state or "uncordoned")
        return await self.move_sessions_off(name) if drained else 0

    async def move_sessions_off(self, name: str) -> int:
        """Move the sessions this gateway knows on ``name`` to replicas open to new sessions."""
        full = self.book.snapshot(self.clock())
        open_ = Snapshot(tuple(s for s in full.replicas if s.name == name or s.name not in self.cordons))
        return await self.rebalancer.on_leave(name, self.profile().ring_for(full), open_)

    async def after_scrape(self, transitions: Sequence[Transition]) -> None:
        """After each health round: move the sessions of replicas that left the rotation, and shed
        sessions from replicas that have run hot for a while."""
        if self.kv_events is not None:  # the engines' cache layout as their pages report it
            self.kv_events.engine_pages(
                (rec.replica.name, rec.metrics.block_size, rec.metrics.hash_algo, rec.metrics.models)
                for rec in self.book.records()
                if rec.metrics is not None
            )
        if self.queue is not None:
            self.queue.wake()  # fresh load figures: headroom may have appeared
        snapshot = self.book.snapshot(self.clock())
        await self.refresh_cordons()
        for t in transitions:
            if not t.in_rotation:
                await self.rebalancer.on_leave(t.replica, self.profile().ring_for(snapshot), snapshot)
        await self.rebalancer.check_hot(snapshot)
