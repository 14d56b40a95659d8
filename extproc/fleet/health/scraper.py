"""The scraper: reads every replica's /metrics page on an interval and judges replicas.

Slow, broken and missing pages are expected: each fetch has its own timeout far below the
interval, a page that does not parse counts as a failed scrape, and a connection refused counts
as a hard failure (nothing listens: the replica leaves the rotation at once). The scraper is
never on the request path: decisions read whatever it last stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.health.observer import HealthObserver, NullHealthObserver
from extproc.fleet.health.replicas import ReplicaBook, Transition
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.health.vllm_metrics import MetricsPageError, parse_vllm_metrics

log = logging.getLogger("extproc.fleet.health")


class ScrapeError(Exception):
    """A page could not be fetched; ``refused`` when nothing accepted the connection,
    ``timed_out`` when the page did not come within the scrape budget."""

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out


Fetch = Callable[[str, float], Awaitable[str]]
"""``fetch(url, timeout_s) -> page text``; raises :class:`ScrapeError`."""


class HttpFetch:
    """The default :data:`Fetch`: one pooled aiohttp session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str, timeout_s: float) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise ScrapeError(f"HTTP {resp.status}")
                return str(await resp.text())
        except aiohttp.ClientConnectorError as exc:
            raise ScrapeError(f"connection failed: {exc.os_error}", refused=True) from None
        except TimeoutError:
            raise ScrapeError(f"no page within {timeout_s:g} s", timed_out=True) from None
        except (aiohttp.ClientError, UnicodeDecodeError) as exc:
            raise ScrapeError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


class Scraper:
    """Scrapes every replica of a :class:`ReplicaBook` and evaluates their health."""

    def __init__(
        self,
        book: ReplicaBook,
        settings: HealthSettings,
        clock: Callable[[], float],
        fetch: Fetch | None = None,
        metrics: HealthObserver | None = None,
        listener: Callable[[list[Transition]], Awaitable[None]] | None = None,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.book = book
        self.world = world  # the interval between rounds is slept on its time
        self.settings = settings
        self.clock = clock
        self.fetch: Fetch = fetch or HttpFetch()
        self.metrics: HealthObserver = metrics or NullHealthObserver()
        self.listener = listener

    async def _scrape(self, name: str, address: str) -> None:
        url = f"http://{address}{self.settings.metrics_path}"
        try:
            text = await self.fetch(url, self.settings.scrape_timeout_s)
            metrics = parse_vllm_metrics(text)
        except (ScrapeError, MetricsPageError) as exc:
            refused = isinstance(exc, ScrapeError) and exc.refused
            timed_out = isinstance(exc, ScrapeError) and exc.timed_out
            self.book.scrape_failed(name, refused, timed_out=timed_out, now=self.clock())
            self.metrics.scrape_failed(name)
            log.debug("scrape of %s failed: %s", name, exc)
            return
        self.book.apply_scrape(name, metrics, self.clock())

    async def scrape_once(self) -> list[Transition]:
        """Scrape every replica concurrently, then evaluate; returns rotation changes."""
        await asyncio.gather(*(self._scrape(r.replica.name, r.replica.address) for r in self.book.records()))
        transitions = self.book.evaluate(self.clock())
        for t in transitions:
            verb = "joined" if t.in_rotation else "left"
            log.info("replica %s %s the rotation (health %.2f)", t.replica, verb, t.score)
            if not t.in_rotation:
                self.metrics.left_rotation(t.replica)
        if self.listener is not None:
            await self.listener(transitions)
        return transitions

    async def run(self) -> None:
        """Scrape on the interval until cancelled."""
        try:
            while True:
                started = self.clock()
                try:
                    await self.scrape_once()
                except Exception:  # a bug here must not stop health tracking for good
                    log.exception("scrape round failed")
                elapsed = self.clock() - started
                await self.world.sleep(max(0.0, self.settings.scrape_interval_s - elapsed))
        finally:
            close = getattr(self.fetch, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
