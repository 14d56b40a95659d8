"""Every port the processor opens, bound before it says SERVING.

A processor that serves gRPC while another listener failed to bind (two processors on one host
with the same default metrics port) would look healthy to Envoy and to its probes and then fail.
So start-up binds each listener in turn, before the health service reports anything, and the
first failure stops it: the listeners already bound are closed and :class:`BindError` names the
address and what it was for, which ``extproc serve`` prints before exiting non-zero.

The gRPC listeners (ext_proc and the plaintext health port) bind when
:class:`~extproc.server.app.ProcessorServer` is built; the others are :class:`Listener` objects
handed to :func:`bind_all` (the metrics endpoint with the console, and the admin API:
:class:`extproc.admin.server.AdminServer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.metrics_http import start_metrics_server

log = logging.getLogger("extproc.server")


class BindError(Exception):
    """A listener could not bind; the message names its role and address."""

    def __init__(self, role: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address} ({role}): {reason}")
        self.role = role
        self.address = address


class Listener(Protocol):
    """One port the processor serves besides gRPC."""

    role: str
    address: str

    async def bind(self) -> None:
        """Bind and start serving; raises :class:`BindError`."""

    async def close(self) -> None:
        """Stop serving (idempotent)."""


class MetricsListener:
    """``/metrics`` and ``/healthz`` over HTTP (:func:`~extproc.metrics_http.start_metrics_server`)."""

    role = "metrics"

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        before_scrape: Callable[[], None],
        extra: Callable[[web.Application], object] | None = None,
    ) -> None:
        self.registry = registry
        self.address = address
        self.before_scrape = before_scrape
        self.extra = extra  # more read-only routes on the same port (the console)
        self._runner: web.AppRunner | None = None

    async def bind(self) -> None:
        """Start the HTTP server on :attr:`address`."""
        try:
            self._runner = await start_metrics_server(self.registry, self.address, self.before_scrape, self.extra)
        except (OSError, ValueError) as exc:
            raise BindError(self.role, self.address, _reason(exc)) from None

    async def close(self) -> None:
        """Stop the HTTP server."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.rpartition(": ")[2] or exc.strerror
    return str(exc)


async def bind_all(listeners: Sequence[Listener]) -> None:
    """Bind every listener in order; on the first failure close those bound and raise it."""
    bound: list[Listener] = []
    for listener in listeners:
        try:
            await listener.bind()
        except BindError:
            for done in reversed(bound):
                await done.close()
            raise
        bound.append(listener)
        log.info("%s listening on %s", listener.role, listener.address)


async def close_all(listeners: Sequence[Listener]) -> None:
    """Close every listener, last bound first."""
    for listener in reversed(listeners):
        await listener.close()
