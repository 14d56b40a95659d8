"""The metrics endpoint, on its own port, apart from the gRPC listener."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def start_metrics_server(
    registry: CollectorRegistry,
    listen: str,
    before_scrape: Callable[[], None] | None = None,
    extra: Callable[[web.Application], object] | None = None,
) -> web.AppRunner:
    """Serve ``/metrics`` (and ``/healthz``) on ``listen`` (HOST:PORT); returns the runner to clean up.

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
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = listen.rpartition(":")
    await web.TCPSite(runner, host, int(port)).start()
    return runner
