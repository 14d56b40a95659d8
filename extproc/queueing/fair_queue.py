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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.queueing.levels import PriorityLevels
from extproc.queueing.observer import NullQueueObserver, QueueObserver
from extproc.queueing.settings import QueueSettings

log = logging.getLogger("extproc.queueing")

Pool = tuple[tuple[str, str], ...]
TICK_S = 0.05  # how often a pump blocked on saturation looks again without being woken
SETTLE_S = 1.0  # a released waiter that never reports being routed stops blocking the pump after this


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the queue would not hold or held too long."""

    status: int
    retry_after_s: int
    message: str
    kind: str


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place: granted when the pump releases it, settled once it is routed."""

    tenant: str
    pool: Pool
    priority: int
    granted: asyncio.Future[None]
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self) -> None:
        """The request has been routed (or has given up): the pump may release the next one."""
        self.settled.set()


class FairQueue:
    """Priority queues, fair by tenant, drained as the candidates of their head have headroom."""

    def __init__(
        self, settings: QueueSettings, saturated: Callable[[Pool], bool], metrics: QueueObserver | None = None
    ) -> None:
        """``saturated(pool)`` says whether every candidate of a pool is saturated now."""
        self.settings = settings
        self.saturated = saturated
        self.metrics: QueueObserver = metrics or NullQueueObserver()
        self._levels: PriorityLevels[Ticket] = PriorityLevels()
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._levels)

    def waiting(self, priority: int) -> int:
        """Requests waiting at ``priority``."""
        return self._levels.waiting(priority)

    def wake(self) -> None:
        """Something changed (a scrape, a request ended): look at the head again."""
        self._wake.set()

    async def admit(self, request_class: str, tenant: str, pool: Pool) -> Refusal | Ticket | None:
        """Wait until the request may be routed. None: it went straight on; a :class:`Ticket`: it
        waited and was released (settle it once routed); a :class:`Refusal`: answer it with that."""
        terms = self.settings.for_class(request_class)
        if not self._levels.ahead(terms.priority) and not self.saturated(pool):
            return None
        if self._levels.waiting(terms.priority) >= terms.max_queued:
            self._count(request_class, "full")
            return Refusal(
                terms.status, terms.retry_after_s, "every replica is saturated and the queue is full", "queue_full"
            )
        ticket = Ticket(tenant, pool, terms.priority, asyncio.get_running_loop().create_future())
        self._levels.push(terms.priority, tenant, ticket)
        self._gauge(terms.priority)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name="extproc-queue-pump")
        self.wake()
        start = asyncio.get_running_loop().time()
        try:
            done, _ = await asyncio.wait((ticket.granted,), timeout=terms.max_wait_s)
        except asyncio.CancelledError:
            # The client went away (Envoy closed the stream): give up the place, or the grant.
            self._leave(ticket, request_class, "gone")
            raise
        waited = asyncio.get_running_loop().time() - start
        self.metrics.queue_waited(request_class, waited)
        if not done:
            self._leave(ticket, request_class, "timeout")
            return Refusal(
                terms.status,
                terms.retry_after_s,
                f"every replica stayed saturated for {terms.max_wait_s:g} s",
                "queue_timeout",
            )
        self._count(request_class, "dispatched")
        return ticket

    def _leave(self, ticket: Ticket, request_class: str, outcome: str) -> None:
        if self._levels.remove(ticket.priority, ticket.tenant, ticket):
            self._gauge(ticket.priority)
            self._count(request_class, outcome)
        else:
            ticket.settle()  # released just now: do not hold the pump for it
        if not ticket.granted.done():
            ticket.granted.cancel()

    async def _run(self) -> None:
        while True:
            ticket = self._levels.head()
            if ticket is None:
                return
            if self.saturated(ticket.pool):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), TICK_S)
                continue
            self._levels.pop()
            self._gauge(ticket.priority)
            ticket.granted.set_result(None)
            try:
                await asyncio.wait_for(ticket.settled.wait(), SETTLE_S)
            except TimeoutError:
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
