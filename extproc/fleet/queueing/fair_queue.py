"""Holding requests while the fleet is full: bounded queues per priority, round robin by tenant
within a priority, one request released at a time as replicas report headroom.

A request arrives through :meth:`FairQueue.admit`. It goes straight on when no request of its
priority or above is waiting and its candidates are not all saturated; otherwise it waits. A
single pump releases waiters, highest priority first (a higher priority never waits behind a
lower one), fair by tenant within a priority, and only while the head waiter's candidates have
headroom. It releases the next one only after the last has been routed (its ticket settled), so
each release sees the load the previous one added. A waiter past its class's limit is refused
(429 or 503 with Retry-After); one whose client went away (its task cancelled: Envoy closed the
ext_proc stream) leaves the queue.

The decisions are :class:`~extproc.fleet.queueing.admission.Admission`'s (the simulator drives the same
class on its virtual clock); this module is their asyncio driver and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.base.world import REAL_WORLD, Cancellable, World
from extproc.fleet.queueing.admission import Admission, Pool, Refusal, Waiter
from extproc.fleet.queueing.observer import NullQueueObserver, QueueObserver
from extproc.fleet.queueing.settings import QueueSettings

log = logging.getLogger("extproc.fleet.queueing")

TICK_S = 0.05  # how often a pump blocked on saturation looks again without being woken
SETTLE_S = 1.0  # a released waiter that never reports being routed stops blocking the pump after this


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place: granted (None) when the pump releases it, or its refusal when its time is
    up; settled once it is routed."""

    granted: asyncio.Future[Refusal | None]
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self) -> None:
        """The request has been routed (or has given up): the pump may release the next one."""
        self.settled.set()


class FairQueue:
    """Priority queues, fair by tenant, drained as the candidates of their head have headroom."""

    def __init__(
        self,
        settings: QueueSettings,
        saturated: Callable[[Pool], bool],
        metrics: QueueObserver | None = None,
        clock: Callable[[], float] | None = None,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        """``saturated(pool)`` says whether every candidate of a pool is saturated now; waits are
        timed by ``world`` (:mod:`extproc.base.world`), deadlines by its clock unless ``clock`` is given."""
        self.metrics: QueueObserver = metrics or NullQueueObserver()
        self.world = world
        self.clock = clock = clock or world.monotonic
        self.admission: Admission[Ticket] = Admission(settings, saturated, clock)
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._expiry: Cancellable | None = None
        self._expiry_at = math.inf

    def __len__(self) -> int:
        return len(self.admission)

    def waiting(self, priority: int) -> int:
        """Requests waiting at ``priority``."""
        return self.admission.waiting(priority)

    def wake(self) -> None:
        """Something changed (a scrape, a request ended): look at the head again."""
        self._wake.set()

    async def admit(
        self,
        request_class: str,
        tenant: str,
        pool: Pool,
        ready: Callable[[], bool] | None = None,
        demotion: int = 0,
    ) -> Refusal | Ticket | None:
        """Wait until the request may be routed. None: it went straight on; a :class:`Ticket`: it
        waited and was released (settle it once routed); a :class:`Refusal`: answer it with that.
        With ``ready`` it waits for its latency objectives (:meth:`Admission.admit`)."""
        ticket = Ticket(asyncio.get_running_loop().create_future())
        waiter = self.admission.admit(request_class, tenant, pool, ticket, ready, demotion)
        if waiter is None:
            return None
        if isinstance(waiter, Refusal):
            self._count(request_class, "full")
            return waiter
        self._gauge(waiter.priority)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name="extproc-queue-pump")
        self.wake()
        self._arm_expiry()
        try:
            refusal = await ticket.granted
        except asyncio.CancelledError:
            # The client went away (Envoy closed the stream): give up the place, or the grant.
            self._leave(waiter)
            raise
        self.metrics.queue_waited(request_class, self.clock() - waiter.since)
        if refusal is not None:
            return refusal
        self._count(request_class, "dispatched")
        return ticket

    def _leave(self, waiter: Waiter[Ticket]) -> None:
        if self.admission.leave(waiter):
            self._gauge(waiter.priority)
            self._count(waiter.request_class, "gone")
        else:
            waiter.item.settle()  # released just now: do not hold the pump for it

    def _arm_expiry(self) -> None:
        """A timer for the next deadline, unless one as early is set."""
        deadline = self.admission.next_deadline()
        if deadline is None or deadline >= self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = self.world.call_later(deadline - self.clock(), self._expire)

    def _expire(self) -> None:
        self._expiry, self._expiry_at = None, math.inf
        for waiter, refusal in self.admission.expire():
            self._gauge(waiter.priority)
            self._count(waiter.request_class, "timeout")
            if not waiter.item.granted.done():
                waiter.item.granted.set_result(refusal)
        self._arm_expiry()

    async def _run(self) -> None:
        while len(self.admission):
            waiter = self.admission.next_to_go()
            if waiter is None:
                self._wake.clear()
                await self.world.wait_event(self._wake, TICK_S)
                continue
            self._gauge(waiter.priority)
            ticket = waiter.item
            if ticket.granted.done():
                continue  # cancelled, its task not yet told: it leaves without holding the pump
            ticket.granted.set_result(None)
            if not await self.world.wait_event(ticket.settled, SETTLE_S):
                log.debug("a released request took over %.1fs to be routed", SETTLE_S)

    def _gauge(self, priority: int) -> None:
        self.metrics.queue_depth(priority, self.waiting(priority))

    def _count(self, request_class: str, outcome: str) -> None:
        self.metrics.queue_outcome(request_class, outcome)

    async def close(self) -> None:
        """Stop the pump (waiters keep waiting until their own limit)."""
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
