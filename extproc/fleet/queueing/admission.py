"""The fair queue's decisions, without IO: whether a request goes on, waits or is refused, which
waiter goes next, and which have waited past their class's limit.

:class:`Admission` keeps no time of its own (an injected clock) and wakes nobody: a driver calls
it when something happens and acts on what it answers. The ext_proc server's driver is
:class:`~extproc.fleet.queueing.fair_queue.FairQueue` (asyncio: futures, a pump task, a timer for the
next deadline); the simulator drives it from its virtual clock's events.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from extproc.fleet.queueing.levels import PriorityLevels
from extproc.fleet.queueing.settings import QueueClass, QueueSettings

T = TypeVar("T")
Pool = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the queue would not hold or held too long."""

    status: int
    retry_after_s: int
    message: str
    kind: str


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """A held request: the driver's ``item`` for it, its class's terms and when it must leave."""

    item: T
    request_class: str
    tenant: str
    pool: Pool
    terms: QueueClass
    since: float
    deadline: float
    held: bool = True
    ready: Callable[[], bool] | None = None
    """Held for its latency objective: it may go only once this says so (and its pool has headroom)."""

    @property
    def priority(self) -> int:
        """Its class's priority (higher goes first)."""
        return self.terms.priority


class Admission(Generic[T]):
    """Bounded queues per priority, round robin by tenant within one, each waiter with a deadline.

    ``saturated(pool)`` says whether every candidate of a pool is saturated now; ``clock()`` is
    the time deadlines are reckoned in."""

    def __init__(self, settings: QueueSettings, saturated: Callable[[Pool], bool], clock: Callable[[], float]) -> None:
        self.settings = settings
        self.saturated = saturated
        self.clock = clock
        self._levels: PriorityLevels[Waiter[T]] = PriorityLevels()
        self._deadlines: list[tuple[float, int, Waiter[T]]] = []  # stale entries (gone) skipped lazily
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._levels)

    def waiting(self, priority: int) -> int:
        """Requests waiting at ``priority``."""
        return self._levels.waiting(priority)

    def admit(
        self,
        request_class: str,
        tenant: str,
        pool: Pool,
        item: T,
        ready: Callable[[], bool] | None = None,
        demotion: int = 0,
    ) -> Waiter[T] | Refusal | None:
        """A request arrives. None: it goes straight on (nothing of its priority or above waits and
        its candidates have headroom); a :class:`Refusal`: its priority's queue is full; a
        :class:`Waiter`: it waits, as ``item``, until :meth:`next_to_go` or :meth:`expire` returns it.

        With ``ready`` it was decided on already and every candidate was predicted to miss its
        latency objectives: it waits whatever the fleet's load, until ``ready()`` (and headroom)."""
        terms = self.settings.for_class(request_class)
        if demotion > 0:  # a client's priority only ever lowers its request below its class
            terms = terms.model_copy(update={"priority": terms.priority - demotion})
        if ready is None and not self._levels.ahead(terms.priority) and not self.saturated(pool):
            return None
        if self._levels.waiting(terms.priority) >= terms.max_queued:
            return Refusal(
                terms.status, terms.retry_after_s, "every replica is saturated and the queue is full", "queue_full"
            )
        now = self.clock()
        waiter = Waiter(item, request_class, tenant, pool, terms, now, now + terms.max_wait_s, ready=ready)
        self._levels.push(terms.priority, tenant, waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._order), waiter))
        return waiter

    def next_to_go(self) -> Waiter[T] | None:
        """Take the waiter that goes now: the head (highest priority, the tenant whose turn it is)
        when its candidates have headroom (and, held for its objectives, when one is predicted to
        meet them); None when nothing waits or the head must wait on. The head holds back those
        behind it, as a saturated pool does: a class that queues on a miss is worth the wait."""
        waiter = self._levels.head()
        if waiter is None or self.saturated(waiter.pool) or (waiter.ready is not None and not waiter.ready()):
            return None
        self._levels.pop()
        self._gone(waiter)
        return waiter

    def expire(self) -> list[tuple[Waiter[T], Refusal]]:
        """Take every waiter whose deadline has come, wherever it is in the queue, with its refusal."""
        now = self.clock()
        out = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(deadlines)
            if waiter.held:
                self._levels.remove(waiter.priority, waiter.tenant, waiter)
                waiter.held = False
                terms = waiter.terms
                if waiter.ready is not None:
                    message = f"no replica was predicted to meet the latency objectives within {terms.max_wait_s:g} s"
                    refusal = Refusal(terms.status, terms.retry_after_s, message, "objective_timeout")
                else:
                    message = f"every replica stayed saturated for {terms.max_wait_s:g} s"
                    refusal = Refusal(terms.status, terms.retry_after_s, message, "queue_timeout")
                out.append((waiter, refusal))
        return out

    def next_deadline(self) -> float | None:
        """When the next waiter's limit comes (call :meth:`expire` then); None when nothing waits."""
        deadlines = self._deadlines
        while deadlines and not deadlines[0][2].held:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def leave(self, waiter: Waiter[T]) -> bool:
        """The waiter gave up (its client went away); False when it had already left the queue."""
        if not waiter.held:
            return False
        self._levels.remove(waiter.priority, waiter.tenant, waiter)
        self._gone(waiter)
        return True

    def _gone(self, waiter: Waiter[T]) -> None:
        waiter.held = False
        # Deadlines of waiters gone are dropped lazily; rebuild before they outnumber the held.
        if len(self._deadlines) > 2 * len(self._levels) + 64:
            self._deadlines = [d for d in self._deadlines if d[2].held]
            heapq.heapify(self._deadlines)
