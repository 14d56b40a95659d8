"""List, then watch, one collection of Kubernetes objects: the API server's list+watch protocol
(:mod:`extproc.fleet.discovery.kubernetes_watch` describes it) for any resource, as a stream of
:class:`Change` values.

:class:`KubernetesDiscovery` follows EndpointSlices with its own copy of this loop; the
InferencePool source (:mod:`extproc.fleet.discovery.pool_watch`) follows two collections at once (the
pool, and the pods it selects), so the loop is a piece of its own here: a reflector lists, yields
the whole list, watches from the list's version, yields each change, resumes a watch the server
ended, lists again after ``410 Gone``, and retries anything else with backoff, yielding nothing
meanwhile (what was last yielded stays true for its consumer).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.endpoint_slices import resource_version
from extproc.fleet.discovery.kubernetes_watch import (
    LIST_TIMEOUT_S,
    MIN_QUIET_WATCH_S,
    ApiError,
    Backoff,
    Gone,
    watch_events,
)

log = logging.getLogger("extproc.fleet.discovery")

ListCall = Callable[..., Awaitable[Any]]
"""A client's ``list_..._without_preload_content`` with its collection's arguments bound: called
with the list's or the watch's query arguments, it returns the raw aiohttp response."""


@dataclass(frozen=True, slots=True)
class Change:
    """``reset``: ``items`` is the whole collection now (after a list). ``put``/``delete``: ``item``
    was added or modified, or deleted (or, for a selector, stopped matching)."""

    kind: Literal["reset", "put", "delete"]
    items: tuple[Mapping[str, Any], ...] = ()
    item: Mapping[str, Any] | None = None


class Reflector:
    """Lists and watches one collection until cancelled (see the module's docstring)."""

    def __init__(
        self, call: ListCall, what: str, backoff: Backoff, watch_timeout_s: int, world: World = REAL_WORLD
    ) -> None:
        self.call = call
        self.world = world  # backoffs are slept on its time
        self.what = what
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        self.lists = 0

    def __repr__(self) -> str:
        return self.what

    async def changes(self) -> AsyncGenerator[Change, None]:
        """The collection's changes, a ``reset`` first and after every new list; never raises on
        the API server's or the network's failures."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    version, items = await self._list()
                    self.backoff.reset()
                    yield Change("reset", items)
                started = self.world.monotonic()
                events = 0
                async with contextlib.aclosing(self._watch(version)) as watch:
                    async for resume_from, change in watch:
                        version = resume_from
                        events += 1
                        self.backoff.reset()
                        if change is not None:
                            yield change
                if events == 0 and self.world.monotonic() - started < MIN_QUIET_WATCH_S:
                    await self.world.sleep(self.backoff.next())
            except Gone:
                log.info("%s: resourceVersion %s expired, listing again", self, version)
                version = None
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                delay = self.backoff.next()
                log.warning("%s: %s: %s; retrying in %.1fs", self, type(exc).__name__, exc, delay)
                await self.world.sleep(delay)

    async def _list(self) -> tuple[str, tuple[Mapping[str, Any], ...]]:
        self.lists += 1
        resp = await self.call(_request_timeout=LIST_TIMEOUT_S)
        try:
            if resp.status != 200:
                raise ApiError(resp.status, (await resp.text())[:200])
            body = await resp.json(content_type=None)
        finally:
            resp.release()
        if not isinstance(body, Mapping) or not isinstance(body.get("items") or [], list):
            raise ValueError(f"{self}: the list response is not a list")
        items = tuple(item for item in body.get("items") or () if isinstance(item, Mapping))
        return resource_version(body) or "", items

    async def _watch(self, version: str) -> AsyncGenerator[tuple[str, Change | None], None]:
        resp = await self.call(
            watch=True,
            resource_version=version or None,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=float(self.watch_timeout_s + 30),
        )
        async for kind, obj in watch_events(resp):
            version = resource_version(obj) or version
            if kind in ("ADDED", "MODIFIED"):
                yield version, Change("put", item=obj)
            elif kind == "DELETED":
                yield version, Change("delete", item=obj)
            else:  # BOOKMARK: only the version moves on
                yield version, None
