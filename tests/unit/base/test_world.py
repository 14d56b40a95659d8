"""The manual world: time moves only when the test moves it, sleepers wake in deadline order,
waits and timers follow it; the real world's waits are the event loop's."""

from __future__ import annotations

import asyncio

import pytest

from extproc.base.world import REAL_WORLD, ManualWorld


async def test_sleepers_wake_in_deadline_order_with_time_at_their_deadline() -> None:
    world = ManualWorld(now=10.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await world.sleep(seconds)  # the manual world's time: no real wait
        woke.append((name, world.monotonic()))

    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("late", 3.0), ("early", 1.0), ("mid", 2.0))]
    await world.advance(1.5)
    assert woke == [("early", 11.0)] and world.monotonic() == 11.5 and world.sleepers == 2
    await world.advance(10.0)
    assert woke == [("early", 11.0), ("mid", 12.0), ("late", 13.0)] and world.monotonic() == 21.5
    assert world.wall() == 21.5 + world.wall_offset
    await asyncio.gather(*tasks)


async def test_a_wait_ends_on_its_future_or_at_its_timeout_and_a_timer_fires_on_time() -> None:
    world = ManualWorld()
    event = asyncio.Event()
    waiting = asyncio.create_task(world.wait_event(event, 5.0))
    await world.advance(4.9)
    assert not waiting.done()
    await world.advance(0.2)
    assert waiting.done() and waiting.result() is False
    waiting = asyncio.create_task(world.wait_event(event, 5.0))
    await world.advance(1.0)
    event.set()
    await world.advance()
    assert waiting.result() is True
    fired: list[float] = []
    timer = world.call_later(2.0, lambda: fired.append(world.monotonic()))
    cancelled = world.call_later(1.0, lambda: fired.append(-1.0))
    cancelled.cancel()
    await world.advance(5.0)
    assert fired == [world.monotonic() - 3.0]
    assert isinstance(timer, asyncio.Future) and timer.done()


async def test_the_manual_world_keeps_its_own_clock_and_draws_repeatably() -> None:
    with pytest.raises(TypeError):
        ManualWorld().with_clock(lambda: 0.0)
    assert ManualWorld(seed=3).random.random() == ManualWorld(seed=3).random.random()


async def test_the_real_world_waits_on_the_event_loop() -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await REAL_WORLD.wait(future, 0.01) is False
    future.set_result(None)
    assert await REAL_WORLD.wait(future, 0.01) is True
    fired = asyncio.Event()
    REAL_WORLD.call_later(0.0, fired.set)
    assert await REAL_WORLD.wait_event(fired, 5.0)
