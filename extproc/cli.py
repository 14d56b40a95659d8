"""The ``extproc`` command line: serve, envoy-config, check-config, admin, calibrate.

Installed packages add sub-commands through the ``extproc.commands`` entry point group (a
function given the sub-parsers, setting ``run`` on each parser it adds): the lab adds ``replica``,
``demo`` and ``bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from extproc import __version__, event_loop
from extproc.config import Config, ConfigError, load_config
from extproc.config import picker_invocation as picker
from extproc.config.cli_flags import add_config_flags, config_from_flags, env_name
from extproc.logs import setup_logging

if TYPE_CHECKING:
    from extproc.kvevents.cache_state import EventCacheState
    from extproc.metrics import RouterMetrics
    from extproc.router import Router
    from extproc.server.workers import WorkerSlot
    from extproc.state.shared_memory import SharedSegment
    from extproc.state.store import AffinityStore

COMMANDS_GROUP = "extproc.commands"
LOG_FORMATS = ("text", "json")


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the ext_proc routing server",
        usage="extproc serve [--config FILE] [--KEY VALUE ...]",
        description="Every key of the config file is a flag and an EXTPROC_ variable (docs/environment-variables.md).",
    )
    # These three are no keys of the file; their variables are their defaults.
    env = os.environ
    p.add_argument(
        "--config",
        default=env.get(env_name("--config")) or None,
        help=f"YAML config file (flags below override it) [env {env_name('--config')}]",
    )
    p.add_argument(
        "--log-level",
        default=env.get(env_name("--log-level")) or "info",
        help=f"debug, info, warning or error [env {env_name('--log-level')}]",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env.get(env_name("--log-format")) or "text",
        help=f"text or json [env {env_name('--log-format')}]",
    )
    add_config_flags(p)
    picker.add_picker_flags(p)


def _envoy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Scenario and output names are checked by extproc.envoy_config, imported only for this command.
    p = sub.add_parser(
        "envoy-config", help="render an Envoy bootstrap (or Istio EnvoyFilter) for the router's replicas"
    )
    p.add_argument("--config", help="router YAML config (replicas or discovery, mode, headers, listen)")
    p.add_argument(
        "--scenario",
        help="a preset, as the folders of envoy/: cluster-mode, endpoint-mode, endpoint-original-dst, failover, "
        "unix-socket, kubernetes",
    )
    p.add_argument(
        "--output",
        default="bootstrap",
        help="bootstrap (default), istio-envoyfilter, or istio-header-strip (the strip alone, for a GIE gateway)",
    )
    p.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT")
    p.add_argument("--mode", choices=["cluster", "endpoint"])
    p.add_argument("--processor", help="the processor's HOST:PORT or unix:/path (default: the config's listen)")
    p.add_argument("--listen", help="the gateway listener (default 127.0.0.1:10000)")
    p.add_argument("--admin", help="the admin interface (default 127.0.0.1:9901)")
    p.add_argument("--round-robin-listen", help="also a plain round-robin listener here")
    p.add_argument(
        "--endpoint-cluster",
        choices=["override_host", "original_dst"],
        help="endpoint mode: a cluster of known replicas with failover (override_host, default), or ORIGINAL_DST",
    )
    p.add_argument("--health-check-path", help="active HTTP health checks of the replicas on this path")
    p.add_argument("--probe-listen", help="a listener exposing only the admin's /ready and /stats/prometheus")
    p.add_argument("--replicas-dns", metavar="HOST:PORT", help="endpoint mode: replicas by DNS (default: discovery)")
    p.add_argument("--istio-namespace", default="istio-system", help="istio-envoyfilter: the gateway's namespace")
    p.add_argument(
        "--istio-gateway",
        metavar="NAME",
        help="istio-header-strip: the Gateway API Gateway whose pods it applies to (default: Istio's ingress gateway)",
    )
    p.add_argument("--processor-ca", metavar="FILE", help="TLS to the processor: the CA of its certificate")
    p.add_argument("--processor-cert", metavar="FILE", help="mTLS: Envoy's client certificate for the processor")
    p.add_argument("--processor-key", metavar="FILE", help="mTLS: the key of --processor-cert")
    p.add_argument("--processor-server-name", metavar="NAME", help="TLS: SNI and the SAN the processor must have")
    p.add_argument(
        "--tracing-collector", metavar="HOST:PORT", help="Envoy's own spans to this OTLP/gRPC collector (plaintext)"
    )
    p.add_argument(
        "--tracing-sample-percent",
        type=float,
        metavar="PERCENT",
        help="share of requests without a sampled traceparent Envoy traces (default: the config's tracing.sample_rate)",
    )


def _check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check-config", help="validate a router config file without starting (exit 2 if invalid)")
    p.add_argument("file", help="router YAML config")


def _serve_worker(argv: Sequence[str], slot: WorkerSlot) -> None:
    """One worker of ``serve --workers N`` (in its own spawned process)."""
    from extproc.server.listeners import BindError
    from extproc.state.shared_memory import SharedSegment

    parser = build_parser()
    _, args = picker.parse_command_line(parser, argv)
    setup_logging(args.log_level, args.log_format)
    _stop_with_parent()
    segment = SharedSegment.attach(slot.segment, slot.lock)
    try:
        # The worker's own ports as flags, which win over the file as any flag does.
        args = parser.parse_args([*argv, *slot.flags(config_from_flags(args.config, args))])
        event_loop.run(_serve(config_from_flags(args.config, args), (slot, segment)))
    except BindError as exc:
        print(f"extproc: worker {slot.index}: {exc}", file=sys.stderr)
        raise SystemExit(3) from None
    except ConfigError as exc:
        print(f"extproc: worker {slot.index}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        pass
    finally:
        segment.close()


def _stop_with_parent() -> None:
    """SIGTERM ourselves when the parent is gone (killed, say): a worker never serves orphaned."""
    import multiprocessing
    import os
    import signal
    import threading

    parent = multiprocessing.parent_process()
    if parent is not None:

        def watch() -> None:
            parent.join()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _open_store(cfg: Config, metrics: RouterMetrics, worker: tuple[WorkerSlot, SharedSegment] | None) -> AffinityStore:
    """The configured store; a worker's memory store is the segment its parent shares."""
    from extproc.state.factory import open_store

    if worker is not None and cfg.store.startswith("memory:"):
        from extproc.state.shared_memory import SharedMemoryStore

        return SharedMemoryStore(worker[1], cfg.sessions.ttl_s, cfg.prefix.blocks_per_replica)
    try:
        return open_store(
            cfg.store, cfg.sessions.ttl_s, cfg.sessions.max_sessions, cfg.prefix.blocks_per_replica, observer=metrics
        )
    except ValueError as exc:  # e.g. an unreadable password file
        raise ConfigError(f"store: {exc}") from None


async def _serve(cfg: Config, worker: tuple[WorkerSlot, SharedSegment] | None = None) -> None:
    # Imported before any port binds: a client that sees the ext_proc port accepting finds the
    # other listeners serving without waiting on these imports.
    from extproc.admin.console import install as install_console
    from extproc.admin.server import place_admin
    from extproc.discovery import run_discovery
    from extproc.health.scraper import Scraper
    from extproc.metrics import RouterMetrics
    from extproc.router import Router
    from extproc.server.app import ProcessorServer
    from extproc.server.handshake_watch import watch_handshakes
    from extproc.server.listeners import Listener, MetricsListener, bind_all, close_all, start_all
    from extproc.server.self_signed import serves_self_signed
    from extproc.state.redis_budgets import RedisBudgetStore
    from extproc.state.redis_store import RedisStore
    from extproc.telemetry import after_scrape, export
    from extproc.tracing import DecisionTracer, TracingUnavailable

    metrics = RouterMetrics()
    self_signed = serves_self_signed(cfg.grpc.tls is not None, cfg.grpc.secure_serving, cfg.discovery.type, cfg.listen)
    watch_handshakes(metrics.tls_handshake_failures, self_signed or bool(cfg.grpc.tls or cfg.admin.tls))
    store = _open_store(cfg, metrics, worker)
    kv_events = None
    kv = cfg.kv_events
    if kv.enabled or kv.listen or any("kv_events" in r.labels for r in cfg.replicas):
        from extproc.kvevents.cache_state import EventCacheState
        from extproc.metrics.kv_events import KvEventMetrics
        from extproc.request.tokenizer import TokenizerError

        try:
            kv_events = EventCacheState(
                kv, metrics=KvEventMetrics(metrics.registry), max_blocks=cfg.features.max_blocks
            )
        except TokenizerError as exc:
            await store.close()
            raise ConfigError(f"kv_events.tokenizers: {exc}") from None
        kv_events.keep_responses(store, cfg.sessions.ttl_s)  # in Redis, shared by every gateway
    try:
        tracer = DecisionTracer(cfg.tracing) if cfg.tracing.enabled else None
    except TracingUnavailable as exc:
        await store.close()
        raise ConfigError(str(exc)) from None
    # With Redis, every gateway's charges count against one budget.
    budget_store = RedisBudgetStore(store.client, store.keys.namespace) if isinstance(store, RedisStore) else None
    router = Router(cfg, store=store, metrics=metrics, kv_events=kv_events, tracer=tracer, budget_store=budget_store)
    if worker is not None:
        from extproc.health.shared_load import PeerLoad

        router.replicas.peers = PeerLoad(worker[1], worker[0].index, cfg.health.recent_half_life_s)
    if kv_events is not None:
        if not kv.enabled:
            logging.getLogger("extproc.kvevents").warning(
                "kv events: no --tokenizer (kv_events.tokenizers): events are indexed but no request matches them"
            )
        kv_events.start(cfg.replicas)
    # Every port is bound before any serves, the ext_proc port last (extproc.server.listeners):
    # Envoy never reaches a processor that then fails to start.
    listeners: list[Listener] = []
    if cfg.metrics.address:
        listeners.append(
            MetricsListener(
                router.metrics.registry, cfg.metrics.address, export(router), lambda app: install_console(app, router)
            )
        )
    try:
        admin = place_admin(router)
        listeners += admin.listeners
        server = ProcessorServer(
            router,
            cfg.listen,
            cfg.grpc.max_message_bytes,
            tls=cfg.grpc.tls,
            health_listen=cfg.grpc.health_listen,
            services=admin.services,
            bind=False,
            reuse_port=worker is not None,
            self_signed=self_signed,
        )
    except ValueError as exc:  # the token file or a certificate or key file
        await _close_early(kv_events, store)
        raise ConfigError(str(exc)) from None
    try:
        await bind_all([*listeners, *server.listeners])
        await start_all(listeners)  # the ext_proc port starts last, in serve_until_signalled
    except BaseException:  # a port that does not bind (BindError)
        await close_all(listeners)
        await _close_early(kv_events, store)
        raise
    scraper = Scraper(router.replicas, cfg.health, router.clock, metrics=router.metrics, listener=after_scrape(router))
    scraping = asyncio.create_task(scraper.run(), name="scraper")
    reporting = asyncio.create_task(_report_budgets(router), name="budgets") if router.budgets else None
    discovering = asyncio.create_task(
        run_discovery(cfg.discovery, router, router.metrics, static=cfg.replicas, cluster_mode=cfg.mode == "cluster"),
        name="discovery",
    )
    # What is alive now (modules, config, the router) lives as long as the process: take it out of
    # the collector's sight, so that a full collection walks only what requests create. Measured
    # here: a full collection went from ~60 ms (a stall every request in flight waits out) to ~2 ms.
    gc.collect()
    gc.freeze()
    try:
        # With discovery and no static replica, the ext_proc service is ready once a list came.
        waiting = not cfg.discovery.is_static and not cfg.replicas
        await server.serve_until_signalled(cfg.grpc.grace_s, (lambda: len(router.replicas) > 0) if waiting else None)
    finally:
        scraping.cancel()
        discovering.cancel()
        if reporting is not None:
            reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraping
        with contextlib.suppress(asyncio.CancelledError):
            await discovering
        await close_all(listeners)
        if kv_events is not None:
            await kv_events.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.close)  # the spans still batched are exported
        await store.close()  # idempotent: a graceful stop has closed it already


BUDGET_REPORT_S = 5.0


async def _report_budgets(router: Router) -> None:
    """Every configured budget's remaining tokens into /metrics, every few seconds (one store read
    for all of them; off the request path)."""
    assert router.budgets is not None
    log = logging.getLogger("extproc.budgets")
    while True:
        try:
            for standing in await router.budgets.standings(router.world.wall()):  # budgets keep wall-clock windows
                for w in standing.windows:
                    router.metrics.budget_stands(standing.kind, standing.name, w.window, w.remaining, w.limit)
        except Exception:  # a store that fails is the ledger's to degrade; the gauges wait
            log.debug("budget standings unavailable", exc_info=True)
        await router.world.sleep(BUDGET_REPORT_S)


async def _close_early(kv_events: EventCacheState | None, store: AffinityStore) -> None:
    """What a start that stops before serving has opened already."""
    if kv_events is not None:
        await kv_events.close()
    await store.close()


def build_parser() -> argparse.ArgumentParser:
    """The ``extproc`` command line: the router's commands, and those of installed plugins (the lab's)."""
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _envoy_parser(sub)
    _check_parser(sub)
    from extproc.admin.client import add_parser as _admin_parser

    _admin_parser(sub)
    from extproc.calibrate import add_parser as _calibrate_parser

    _calibrate_parser(sub)
    for entry in entry_points(group=COMMANDS_GROUP):
        try:
            register = entry.load()
        except ImportError as exc:  # a plugin half-installed must not take the router's commands down
            print(f"extproc: sub-commands {entry.value!r} not loaded: {exc}", file=sys.stderr)
            continue
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``extproc`` console script."""
    parser = build_parser()
    argv, args = picker.parse_command_line(parser, sys.argv[1:] if argv is None else argv)  # GIE's picker's start too
    if getattr(args, "log_format", "text") not in LOG_FORMATS:  # argparse checks a flag, not its variable
        parser.error(f"{env_name('--log-format')}: expected one of {', '.join(LOG_FORMATS)}, got {args.log_format!r}")
    quiet = args.command in ("demo", "bench", "admin", "calibrate")
    setup_logging(getattr(args, "log_level", "warning" if quiet else "info"), getattr(args, "log_format", "text"))
    try:
        if args.command == "serve":
            picker.report_picker_flags(args)
            cfg = config_from_flags(args.config, args)
            if not cfg.replicas and cfg.discovery.is_static:
                parser.error(
                    "serve: no replicas (give --replica NAME=HOST:PORT, or a config file with replicas or discovery)"
                )
            from extproc.server.listeners import BindError

            try:
                if cfg.workers > 1:
                    from extproc.server.workers import check_workers, supervise

                    problem = check_workers(cfg)
                    if problem is not None:
                        raise ConfigError(problem)
                    return supervise(cfg, _serve_worker, argv)
                event_loop.run(_serve(cfg))
            except BindError as exc:
                # Nothing was reported SERVING: a port in use stops the start, naming the address.
                print(f"extproc: {exc}", file=sys.stderr)
                return 3
        elif args.command == "envoy-config":
            from extproc.envoy_config import run_envoy_config

            return run_envoy_config(args, sys.stdout)
        elif args.command == "calibrate":
            from extproc.calibrate import run as run_calibrate

            return run_calibrate(args)
        elif args.command == "check-config":
            cfg = load_config(args.file)
            print(f"{args.file}: ok (mode {cfg.mode}, {len(cfg.replicas)} replicas, discovery {cfg.discovery.type})")
        else:
            run: Callable[[argparse.Namespace], int] = args.run
            return run(args)
    except ConfigError as exc:
        print(f"extproc: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
