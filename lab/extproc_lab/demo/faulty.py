"""A fake replica whose ``/metrics`` page breaks on demand, for the fault matrix.

It is the ordinary fake replica (:func:`extproc_lab.replica.build_app`: it answers completions as
usual) with a switch in front of ``/metrics``:

- ``ok``: the real page;
- ``hang``: the page never comes (the scraper's own timeout has to fire);
- ``garbage``: 200 with something that is not a Prometheus exposition (binary junk, or an HTML
  error page from a proxy in the way);
- ``absurd``: a well-formed page with impossible values (a queue of 10^12, KV usage of 10^9, NaN),
  as a replica with a broken exporter might report;
- ``negative``: a well-formed page with negative gauges (running and waiting below zero), which
  a router that trusted them would read as a replica emptier than idle;
- ``overloaded``: a well-formed, plausible page of a replica at its limit (KV usage 0.95, 50
  requests waiting) while it keeps answering normally: the router should spill its sessions over.

The switch is flipped at run time (``POST /_fault?metrics=hang``), so the replica can first be
healthy and hold sessions, as a real one would when its exporter breaks. A replica that accepts
connections and never answers at all needs no code: SIGSTOP a normal one (the kernel still
completes TCP handshakes into the listen backlog, and nothing ever answers).

    python -m extproc_lab.demo.faulty --name replica-0 --port 8001 [--profile demo] [--time-scale 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from extproc_lab.replica import ReplicaEngine, build_app, get_profile

METRICS_MODES = ("ok", "hang", "garbage", "absurd", "negative", "overloaded")
CONTROL_PATH = "/_fault"

ABSURD_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="demo-model"} 1e15
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="demo-model"} 1e12
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="demo-model"} 1e9
vllm:kv_cache_usage_perc{model_name="other"} NaN
"""
NEGATIVE_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="demo-model"} -3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="demo-model"} -1000
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="demo-model"} -0.5
"""
OVERLOADED_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="demo-model",engine="0"} 16
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="demo-model",engine="0"} 50
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="demo-model",engine="0"} 0.95
"""
HTML_PAGE = "<html><body><h1>502 Bad Gateway</h1></body></html>\n"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MetricsFault:
    """The current ``/metrics`` behaviour of one replica."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.served = 0  # pages answered (or held) since start, for the control endpoint's reply

    async def page(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answer a ``/metrics`` request according to :attr:`mode`."""
        self.served += 1
        if self.mode == "hang":
            # Hold the request until the scraper gives up and closes the connection. aiohttp neither
            # cancels the handlers of departed clients nor offers an event for it: poll the transport.
            while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            return web.Response(status=504)  # written to nobody: the scraper has gone
        if self.mode == "garbage":
            junk = os.urandom(256) if self.served % 2 else HTML_PAGE.encode()
            return web.Response(body=junk, content_type="text/plain")
        if self.mode in ("absurd", "negative"):
            return web.Response(text=ABSURD_PAGE if self.mode == "absurd" else NEGATIVE_PAGE, content_type="text/plain")
        if self.mode == "overloaded":
            return web.Response(text=OVERLOADED_PAGE, content_type="text/plain")
        return await handler(request)


def build_faulty_app(name: str, profile: str = "demo", time_scale: float | None = None) -> web.Application:
    """The fake replica's application with the ``/metrics`` switch and its control endpoint."""
    fault = MetricsFault()

    @web.middleware  # type: ignore[untyped-decorator]  # aiohttp is not type-checked here (pyproject)
    async def switch(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/metrics":
            return await fault.page(request, handler)
        return await handler(request)

    async def control(request: web.Request) -> web.Response:
        mode = request.query.get("metrics", "")
        if mode not in METRICS_MODES:
            return web.json_response({"error": f"metrics: one of {', '.join(METRICS_MODES)}"}, status=400)
        fault.mode = mode
        return web.json_response({"metrics": mode})

    app = build_app(ReplicaEngine(get_profile(profile, time_scale)), name, "demo-model")
    app.middlewares.append(switch)
    app.router.add_post(CONTROL_PATH, control)
    return app


async def serve(name: str, host: str, port: int, profile: str, time_scale: float | None) -> None:
    """Serve until cancelled."""
    runner = web.AppRunner(build_faulty_app(name, profile, time_scale), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m extproc_lab.demo.faulty``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--time-scale", type=float, default=None)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.name, args.host, args.port, args.profile, args.time_scale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
