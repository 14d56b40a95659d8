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

import aiohttp

from extproc.validation import Section, option

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
    for key in ("stream", "stream_options", "max_completion_tokens", "n", "best_of"):
        request.pop(key, None)
    request["max_tokens"] = 1
    return json.dumps(request, separators=(",", ":")).encode()


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


class Prewarmer:
    """Sends pre-warm requests in the background at a bounded rate."""

    def __init__(
        self,
        settings: PrewarmSettings,
        clock: Callable[[], float],
        send: Send = http_send,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.send = send
        self.on_result = on_result or (lambda outcome: None)
        self._pending: deque[tuple[str, str, bytes]] = deque()
        self._wake = asyncio.Event()
        self._tokens = float(settings.burst)
        self._refilled = clock()
        self._task: asyncio.Task[None] | None = None

    def submit(self, address: str, path: str, body: bytes, *, force: bool = False) -> bool:
        """Queue one pre-warm; False (and counted) when disabled, unusable or the queue is full.

        ``force`` sends it even with session pre-warming off: hot-prefix warms (``hot_keys.warm_on_join``)
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
        self._pending.append((address, path, warm))
        self._start()
        return True

    def _start(self) -> None:
        """Make sure something sends what is queued (here, a background task)."""
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prewarm")

    def _take_token(self) -> float:
        now = self.clock()
        self._tokens = min(float(self.settings.burst), self._tokens + (now - self._refilled) * self.settings.rate_per_s)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.settings.rate_per_s

    async def _run(self) -> None:
        while self._pending:
            wait = self._take_token()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            address, path, body = self._pending.popleft()
            try:
                status = await self.send(address, path, body, self.settings.timeout_s)
                self.on_result("ok" if status < 400 else "error")
            except Exception as exc:  # a replica that is gone or slow: the next turn pays, nothing else
                self.on_result("error")
                log.debug("pre-warm of %s failed: %s", address, exc)

    async def drain(self) -> None:
        """Wait until every queued pre-warm has been sent (tests, shutdown)."""
        if self._task is not None:
            await self._task

    async def close(self) -> None:
        """Stop sending."""
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
