"""The ``extproc`` command line: serve, replica, envoy-config, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any

from extproc.config import Config, ConfigError, load_config, parse_replica, with_overrides


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the ext_proc routing server")
    p.add_argument("--config", help="YAML config file (flags below override it)")
    p.add_argument("--listen", help="HOST:PORT or unix:/path (default 127.0.0.1:9002)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="a replica (repeatable); in cluster mode NAME is its Envoy cluster",
    )
    p.add_argument("--mode", choices=["cluster", "endpoint"])
    p.add_argument(
        "--store",
        help="affinity store URL: memory:// (default), redis://, rediss://, unix://, redis+sentinel://, redis+cluster://",
    )
    p.add_argument("--metrics-listen", help="HOST:PORT for /metrics (default 127.0.0.1:9190), 'off' to disable")
    p.add_argument("--log-level", default="info")


def _replica_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replica", help="run a fake vLLM replica (OpenAI API, /metrics, prefix cache)")
    p.add_argument("--name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", default="demo")
    p.add_argument("--model", default="demo-model")
    p.add_argument("--time-scale", type=float, default=None, help="1.0 real time, 0.1 ten times faster")


def _envoy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("envoy-config", help="render an Envoy bootstrap for the router's replicas")
    p.add_argument("--config", help="router YAML config (replicas, mode, headers)")
    p.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT")
    p.add_argument("--mode", choices=["cluster", "endpoint"])
    p.add_argument("--processor", default=None, help="the processor's HOST:PORT or unix:/path")
    p.add_argument("--listen", default="127.0.0.1:10000")
    p.add_argument("--admin", default="127.0.0.1:9901")
    p.add_argument("--round-robin-listen", default=None, help="also a plain round-robin listener here")
    p.add_argument(
        "--endpoint-cluster",
        choices=["override_host", "original_dst"],
        default="override_host",
        help="endpoint mode: a cluster of known replicas with failover (override_host), or ORIGINAL_DST",
    )


def _build_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config) if getattr(args, "config", None) else Config()
    replicas = tuple(parse_replica(s) for s in args.replica) or None
    changes: dict[str, object] = {"replicas": replicas, "mode": args.mode}
    if hasattr(args, "store"):
        changes["store"] = args.store
        changes["listen"] = args.listen
        changes["metrics_listen"] = args.metrics_listen
    cfg = with_overrides(cfg, **changes)
    if getattr(args, "metrics_listen", None) == "off":
        cfg = replace(cfg, metrics_listen=None)
    return cfg


async def _serve(cfg: Config) -> None:
    from extproc.health.scraper import Scraper
    from extproc.metrics import RouterMetrics
    from extproc.metrics_http import start_metrics_server
    from extproc.router import Router
    from extproc.server.app import ProcessorServer
    from extproc.state.factory import open_store

    metrics = RouterMetrics()
    store = open_store(cfg.store, cfg.session_ttl_s, cfg.max_sessions, cfg.blocks_per_replica, observer=metrics)
    router = Router(cfg, store=store, metrics=metrics)
    server = ProcessorServer(router, cfg.listen, cfg.max_message_bytes)
    runner = None
    if cfg.metrics_listen:
        runner = await start_metrics_server(router.metrics.registry, cfg.metrics_listen, router.collect)
    scraper = Scraper(router.replicas, cfg.health, router.clock, metrics=router.metrics)
    scraping = asyncio.create_task(scraper.run(), name="scraper")
    try:
        await server.serve_until_signalled(cfg.grace_s)
    finally:
        scraping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraping
        if runner is not None:
            await runner.cleanup()
        await store.close()  # idempotent: a graceful stop has closed it already


async def _until_signalled(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` until it ends or SIGTERM/SIGINT arrives, then cancel it (its cleanup runs)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``extproc`` console script."""
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _replica_parser(sub)
    _envoy_parser(sub)
    from extproc.demo.cli import add_demo_parser

    add_demo_parser(sub)
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "warning" if args.command == "demo" else "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if args.command == "serve":
            cfg = _build_config(args)
            if not cfg.replicas:
                parser.error("serve: no replicas (give --replica NAME=HOST:PORT or a config file with replicas)")
            asyncio.run(_serve(cfg))
        elif args.command == "replica":
            from extproc.replica import serve_replica

            asyncio.run(
                _until_signalled(
                    serve_replica(args.name, args.host, args.port, args.profile, args.model, args.time_scale)
                )
            )
        elif args.command == "envoy-config":
            from extproc.envoy_config import GatewaySpec, render_yaml

            cfg = _build_config(args)
            spec = GatewaySpec(
                replicas=cfg.replicas,
                processor=args.processor or cfg.listen,
                mode=cfg.mode,
                listen=args.listen,
                admin=args.admin,
                cluster_header=cfg.target_cluster_header,
                endpoint_header=cfg.destination_endpoint_header,
                round_robin_listen=args.round_robin_listen,
                endpoint_cluster=args.endpoint_cluster,
            )
            sys.stdout.write(render_yaml(spec))
        elif args.command == "demo":
            from extproc.demo.cli import run_demo_command

            return run_demo_command(args)
    except ConfigError as exc:
        print(f"extproc: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
