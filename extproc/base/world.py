"""Time and chance, injected: the app's one clock, one sleeper and one random source.

Every loop that waits (health polling, KV-event reconnects, discovery and its backoff, the
store's refresh, pre-warming, the fair queue) takes them from a :class:`World` instead of calling
``asyncio.sleep`` or ``time`` itself. Production runs on :class:`World` (the system's clocks, the
event loop's timers); a test builds a :class:`ManualWorld` and moves its time with
:meth:`ManualWorld.advance`, so what a loop does after a wait is checked without waiting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

Clock = Callable[[], float]
"""Seconds; only differences mean anything (the monotonic clock) or seconds since the epoch (wall)."""
Sleep = Callable[[float], Awaitable[None]]
"""Wait this many seconds of the world's time."""


class Cancellable(Protocol):
    """A timer that can be called off (``asyncio.TimerHandle``, or a task)."""

    def cancel(self) -> Any:
        """Call the timer off."""
        ...


class World:
    """The real world: the system's monotonic and wall clocks, the event loop's timers and a
    random source seeded by the system (each a parameter, for a test to replace one)."""

    def __init__(
        self,
        *,
        monotonic: Clock = time.monotonic,
        wall: Clock = time.time,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        # Plain attributes, not methods: the request path reads the clock several times a
        # request, and ``world.monotonic()`` then costs what ``time.monotonic()`` costs.
        self.monotonic = monotonic
        self.wall = wall
        self.sleep = sleep
        self.random = rng if rng is not None else random.Random()

    def with_clock(self, monotonic: Clock) -> World:
        """This world with another monotonic clock (a test's or the simulator's)."""
        return World(monotonic=monotonic, wall=self.wall, sleep=self.sleep, rng=self.random)

    async def wait(self, future: asyncio.Future[Any], timeout_s: float | None) -> bool:
        """Wait until ``future`` is done or ``timeout_s`` of this world's time passed (None: no
        limit); whether it is done. The future is left running either way."""
        if timeout_s is None or future.done():
            await asyncio.wait({future})
            return True
        if self.sleep is asyncio.sleep:  # the event loop's own timer: no second task
            done, _ = await asyncio.wait({future}, timeout=max(0.0, timeout_s))
            return bool(done)
        timer = asyncio.ensure_future(self.sleep(max(0.0, timeout_s)))
        try:
            await asyncio.wait({future, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        return future.done()

    async def wait_event(self, event: asyncio.Event, timeout_s: float | None) -> bool:
        """Wait until ``event`` is set or ``timeout_s`` passed; whether it is set."""
        if event.is_set():
            return True
        waiter = asyncio.ensure_future(event.wait())
        try:
            return await self.wait(waiter, timeout_s)
        finally:
            waiter.cancel()

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Cancellable:
        """Call ``callback`` after ``delay_s`` of this world's time (in the running loop)."""
        if self.sleep is asyncio.sleep:
            return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

        async def later() -> None:
            await self.sleep(max(0.0, delay_s))
            callback()

        return asyncio.ensure_future(later())


REAL_WORLD = World()
"""The process's world (one random source for all that do not need a seed)."""


class ManualWorld(World):
    """A world whose time moves only when a test moves it: sleepers wake in deadline order as
    :meth:`advance` passes their deadlines, each woken task running until it waits again before
    the next deadline is passed. Its random source is seeded (``seed``)."""

    def __init__(self, now: float = 1000.0, *, wall_offset: float = 1_700_000_000.0, seed: int = 0) -> None:
        super().__init__(monotonic=self._now, wall=self._wall, sleep=self._sleep, rng=random.Random(seed))
        self.now = now
        self.wall_offset = wall_offset
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def _now(self) -> float:
        return self.now

    def _wall(self) -> float:
        return self.now + self.wall_offset

    async def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # as asyncio.sleep(0): let others run
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), future))
        await future

    @property
    def sleepers(self) -> int:
        """Tasks asleep on this world now."""
        return sum(1 for *_, f in self._sleepers if not f.done())

    def with_clock(self, monotonic: Clock) -> World:
        """A manual world keeps its own clock: the sleepers wake by it."""
        raise TypeError("a ManualWorld's clock is its own: set .now or advance() it")

    async def advance(self, seconds: float = 0.0) -> None:
        """Move time ``seconds`` on, waking every sleeper whose deadline it passes (in order,
        time standing at each deadline while the woken run), then let the loop settle."""
        end = self.now + seconds
        await settle()
        while self._sleepers and self._sleepers[0][0] <= end:
            deadline, _, future = heapq.heappop(self._sleepers)
            if future.done():  # its sleeper was cancelled
                continue
            self.now = max(self.now, deadline)
            future.set_result(None)
            await settle()
        self.now = end
        await settle()


async def settle(rounds: int = 50) -> None:
    """Let every task that can run without waiting on time run (a fixed number of loop turns:
    enough for the short chains of awaits the loops here make between two waits)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
