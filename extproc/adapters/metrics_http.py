"""The metrics endpoint, on its own port, apart from the gRPC listener."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def metrics_app(
    registry: CollectorRegistry,
    before_scrape: Callable[[], None] | None = None,
    extra: Callable[[web.Application], object] | None = None,
) -> web.Application:
    """``/metrics`` (and ``/healthz``) of ``registry`` as an application to serve
    (:class:`extproc.adapters.server.listeners.MetricsListener` binds its port).

    ``extra`` adds more read-only routes to the same listener (the console)."""

    async def metrics(_: web.Request) -> web.Response:
        if before_scrape is not None:
            before_scrape()
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    if extra is not None:
        extra(app)
    return app
