"""The discovery loop: from a source's lists to the router's membership, debounced.

Every list a source yields is compared with the last one; a change is applied only once the
list has stayed the same for ``debounce_s`` (an endpoint that goes unready and comes back within
that time causes no join or leave at all), and never later than ``max_delay_s`` after the first
unapplied change (so a fleet where something is always flapping still converges). The first list
is applied at once: at start-up there is nothing to protect. ``set_replicas`` is called only
when the applied set would change; the router logs the joins and leaves, once each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.observer import DiscoveryObserver, NullDiscoveryObserver
from extproc.fleet.discovery.settings import DEBOUNCE_S, MAX_DELAY_S
from extproc.fleet.discovery.source import Discovery, canonical
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")


class MembershipTarget(Protocol):
    """What the loop feeds: the router's :class:`~extproc.core.membership.FleetControl` is one."""

    async def set_replicas(self, replicas: Sequence[Replica]) -> object:
        """Make ``replicas`` the membership."""
        ...


class DiscoveryLoop:
    """Runs a :class:`Discovery` source and applies its changes to a :class:`MembershipTarget`.

    ``static`` replicas (the config's) are members whatever the source says; on a name clash the
    static one wins. If the source fails (raises), the membership is kept and the source is
    started again after ``retry_s``.
    """

    def __init__(
        self,
        source: Discovery,
        target: MembershipTarget,
        debounce_s: float = DEBOUNCE_S,
        max_delay_s: float = MAX_DELAY_S,
        static: Sequence[Replica] = (),
        retry_s: float = 5.0,
        metrics: DiscoveryObserver | None = None,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.source = source
        self.world = world  # the debounce and the retries are timed by it
        self.metrics: DiscoveryObserver = metrics or NullDiscoveryObserver()
        self.target = target
        self.debounce_s = debounce_s
        self.max_delay_s = max(max_delay_s, debounce_s)
        self.static = tuple(static)
        self.retry_s = retry_s
        self.applied: tuple[Replica, ...] | None = None
        self.applies = 0

    async def run(self) -> None:
        """Follow the source until cancelled (or until a finite source, such as the static one,
        has said everything)."""
        while True:
            try:
                await self.follow()
                return
            except Exception:  # a failing source must not end discovery for good
                self.metrics.discovery_failed()
                log.exception("discovery %r failed; restarting it in %.1fs", self.source, self.retry_s)
                await self.world.sleep(self.retry_s)

    async def follow(self) -> None:
        """One run of the source: apply its lists, debounced, until it ends or raises."""
        clock = self.world.monotonic
        updates = aiter(self.source.updates())
        pending: asyncio.Future[Sequence[Replica]] | None = None
        latest: tuple[Replica, ...] | None = None
        due: float | None = None  # when the latest list is applied, if it differs from the applied one
        first_change = 0.0
        try:
            while True:
                if pending is None:
                    # The next list is awaited in a task of its own, so that the debounce timer
                    # can fire while the source is still waiting for news.
                    pending = asyncio.ensure_future(anext(updates))
                timeout = None if due is None else max(0.0, due - clock())
                if not await self.world.wait(pending, timeout):
                    assert latest is not None
                    await self._apply(latest)
                    due = None
                    continue
                received, pending = pending, None
                try:
                    replicas = canonical((*self.static, *received.result()))
                except StopAsyncIteration:
                    if due is not None and latest is not None:
                        await self._apply(latest)
                    return
                self.metrics.discovery_list()
                if replicas == latest:
                    continue  # a repeat (DNS yields every interval): the debounce clock runs on
                latest = replicas
                if self.applied is None:
                    await self._apply(latest)
                    continue
                if latest == self.applied:
                    if due is not None:
                        log.debug(
                            "discovery %r: change undone within %.1fs, nothing applied", self.source, self.debounce_s
                        )
                    due = None
                    continue
                now = clock()
                if due is None:
                    first_change = now
                due = min(now + self.debounce_s, first_change + self.max_delay_s)
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                    await pending
            aclose = getattr(updates, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _apply(self, replicas: tuple[Replica, ...]) -> None:
        if replicas == self.applied:
            return
        before = {r.name: r for r in self.applied or ()}
        await self.target.set_replicas(replicas)
        if self.applied is None:
            log.info("discovery %r: %d replicas", self.source, len(replicas))
        self.applied = replicas
        self.applies += 1
        self.metrics.membership_applied(len(replicas))
        moved = [
            f"{r.name} {before[r.name].address} -> {r.address}"
            for r in replicas
            if r.name in before and before[r.name].address != r.address
        ]
        if moved:
            log.info("discovery %r: new address for %s", self.source, ", ".join(moved))
