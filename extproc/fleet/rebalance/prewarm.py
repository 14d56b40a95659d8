"""Pre-warming: a prefill-only request (``max_tokens: 1``) with a moved session's latest prompt,
sent straight to its new replica, so the session's next turn finds its KV cache there.

Rate-limited (a token bucket) and bounded (a small queue; when it is full, the oldest wishes are
dropped and counted): pre-warming is an optimisation and must never compete with real traffic
for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from extproc.base.validation import Section, option
from extproc.base.world import REAL_WORLD, World
from extproc.request.openai_body import one_token

log = logging.getLogger("extproc.prewarm")

Send = Callable[[str, str, bytes, float], Awaitable[int]]
"""``send(address, path, body, timeout_s) -> HTTP status``; raises on connection errors."""


def prefill_only(body: bytes) -> bytes | None:
    """The same request asking for one token and no stream; None when the body is not usable."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    return json.dumps(one_token(request), separators=(",", ":")).encode()


class PrewarmSettings(Section):
    """``rebalance.prewarm:``: prefill-only requests that warm a moved session's new replica."""

    # Off by default: in the simulator (benchmarks/scaling.md) pre-warms landing during a fleet change
    # raised everyone's TTFT p99 more than they saved the moved sessions; turn it on where moves are
    # rare and prompts long.
    enabled: bool = option(False, "off: in the simulator pre-warms during fleet changes cost more")
    rate_per_s: float = option(5.0, "pre-warm requests per second at most", ge=0.001)
    burst: int = option(5, "token-bucket burst", ge=1)
    queue: int = option(256, "pending pre-warms kept at most", ge=1)
    timeout_s: float = option(30.0, "a pre-warm slower than this is abandoned", ge=0.001)


async def http_send(address: str, path: str, body: bytes, timeout_s: float) -> int:
    """The default :data:`Send`: a plain HTTP POST to the replica."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{address}{path}",
            data=body,
            headers={"content-type": "application/json", "x-extproc-prewarm": "1"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp,
    ):
        await resp.read()
        return int(resp.status)


@dataclass(frozen=True, slots=True)
class Prewarm:
    """One pre-warm to send: the prefill-only body, to the replica at ``address``."""

    address: str
    path: str
    body: bytes


class PrewarmQueue:
    """The pre-warms waiting to go and the token bucket that lets them out, without IO: a driver
    sends what :meth:`take` hands it, when it says (the ext_proc server's is :class:`Prewarmer`,
    the simulator's its virtual clock's events). ``on_result(outcome)`` counts each pre-warm's fate."""

    def __init__(self, settings: PrewarmSettings, clock: Callable[[], float], on_result: Callable[[str], None]) -> None:
        self.settings = settings
        self.clock = clock
        self.on_result = on_result
        self._pending: deque[Prewarm] = deque()
        self._tokens = float(settings.burst)
        self._refilled = clock()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, address: str, path: str, body: bytes, *, force: bool = False) -> bool:
        """Queue one pre-warm; False (and counted) when disabled, unusable or the queue is full.

        ``force`` queues it even with session pre-warming off: hot-prefix warms (``hot_keys.warm_on_join``)
        have their own switch and share this rate limit."""
        if not self.settings.enabled and not force:
            return False
        warm = prefill_only(body)
        if warm is None:
            self.on_result("unusable")
            return False
        if len(self._pending) >= self.settings.queue:
            self._pending.popleft()
            self.on_result("dropped")
        self._pending.append(Prewarm(address, path, warm))
        return True

    def take(self) -> Prewarm | float | None:
        """The pre-warm to send now (it takes a token); else the seconds until the bucket lets the
        next one go (ask again then); None when nothing is queued."""
        if not self._pending:
            return None
        now = self.clock()
        self._tokens = min(float(self.settings.burst), self._tokens + (now - self._refilled) * self.settings.rate_per_s)
        self._refilled = now
        if self._tokens < 1.0:
            return (1.0 - self._tokens) / self.settings.rate_per_s
        self._tokens -= 1.0
        return self._pending.popleft()

    def sent(self, status: int | None) -> None:
        """How a pre-warm :meth:`take` handed out went: its HTTP status, None when sending failed."""
        self.on_result("ok" if status is not None and status < 400 else "error")

    def clear(self) -> None:
        """Forget what is queued."""
        self._pending.clear()


class Prewarmer:
    """Sends pre-warm requests in the background at a bounded rate: the asyncio driver of a
    :class:`PrewarmQueue`.

    ``schedule()`` is called whenever a pre-warm is queued; by default it makes sure a background
    task sends what is queued through ``send``. A driver of its own (the simulator's) passes its
    own and sends what :attr:`queue` hands out itself."""

    def __init__(
        self,
        settings: PrewarmSettings,
        clock: Callable[[], float],
        send: Send = http_send,
        on_result: Callable[[str], None] | None = None,
        schedule: Callable[[], None] | None = None,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.queue = PrewarmQueue(settings, clock, on_result or (lambda outcome: None))
        self.send = send
        self.world = world  # the pacing between sends sleeps on its time
        self.schedule = schedule or self._start
        self._task: asyncio.Task[None] | None = None

    def submit(self, address: str, path: str, body: bytes, *, force: bool = False) -> bool:
        """Queue one pre-warm (:meth:`PrewarmQueue.submit`) and see that it is sent."""
        if not self.queue.submit(address, path, body, force=force):
            return False
        self.schedule()
        return True

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prewarm")

    async def _run(self) -> None:
        queue = self.queue
        while (warm := queue.take()) is not None:
            if isinstance(warm, float):
                await self.world.sleep(warm)
                continue
            try:
                status: int | None = await self.send(warm.address, warm.path, warm.body, queue.settings.timeout_s)
            except Exception as exc:  # a replica that is gone or slow: the next turn pays, nothing else
                status = None
                log.debug("pre-warm of %s failed: %s", warm.address, exc)
            queue.sent(status)

    async def drain(self) -> None:
        """Wait until every queued pre-warm has been sent (tests, shutdown)."""
        if self._task is not None:
            await self._task

    async def close(self) -> None:
        """Stop sending."""
        self.queue.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
