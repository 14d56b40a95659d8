"""``extproc serve``: the process that serves. Its store, router, KV events and tracer are made,
every port is bound, then the scraper, discovery and the budgets' report run until a signal; each
worker of ``serve --workers N`` does the same in a process of its own, on the segment its parent
shares (:mod:`extproc.adapters.server.workers`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extproc.base import event_loop
from extproc.base.logs import setup_logging
from extproc.config import Config, ConfigError
from extproc.config import picker_invocation as picker
from extproc.config.cli_flags import config_from_flags

if TYPE_CHECKING:
    from extproc.adapters.server.workers import WorkerSlot
    from extproc.app.router import Router
    from extproc.fleet.kvevents.cache_state import EventCacheState
    from extproc.observe.metrics import RouterMetrics
    from extproc.state.shared_segment import SharedSegment
    from extproc.state.store import AffinityStore


def serve_worker(argv: Sequence[str], slot: WorkerSlot) -> None:
    """One worker of ``serve --workers N`` (in its own spawned process)."""
    from extproc.adapters.cli import build_parser
    from extproc.adapters.server.listeners import BindError
    from extproc.state.shared_segment import SharedSegment

    parser = build_parser()
    _, args = picker.parse_command_line(parser, argv)
    setup_logging(args.log_level, args.log_format)
    _stop_with_parent()
    segment = SharedSegment.attach(slot.segment, slot.lock)
    try:
        # The worker's own ports as flags, which win over the file as any flag does.
        args = parser.parse_args([*argv, *slot.flags(config_from_flags(args.config, args))])
        event_loop.run(serve(config_from_flags(args.config, args), (slot, segment)))
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


async def serve(cfg: Config, worker: tuple[WorkerSlot, SharedSegment] | None = None) -> None:
    """Serve ``cfg`` until a signal (a worker's ``worker``: its slot and the shared segment)."""
    # Imported before any port binds: a client that sees the ext_proc port accepting finds the
    # other listeners serving without waiting on these imports.
    from extproc.adapters.admin.console import install as install_console
    from extproc.adapters.admin.server import place_admin
    from extproc.adapters.server.app import ProcessorServer
    from extproc.adapters.server.handshake_watch import watch_handshakes
    from extproc.adapters.server.listeners import Listener, MetricsListener, bind_all, close_all, start_all
    from extproc.adapters.server.self_signed import serves_self_signed
    from extproc.adapters.telemetry import after_scrape, export
    from extproc.app.router import Router
    from extproc.fleet.discovery import run_discovery
    from extproc.fleet.health.scraper import Scraper
    from extproc.observe.metrics import RouterMetrics
    from extproc.observe.tracing import DecisionTracer, TracingUnavailable
    from extproc.state.redis_budgets import RedisBudgetStore
    from extproc.state.redis_store import RedisStore

    metrics = RouterMetrics()
    self_signed = serves_self_signed(cfg.grpc.tls is not None, cfg.grpc.secure_serving, cfg.discovery.type, cfg.listen)
    watch_handshakes(metrics.tls_handshake_failures, self_signed or bool(cfg.grpc.tls or cfg.admin.tls))
    store = _open_store(cfg, metrics, worker)
    kv_events = None
    kv = cfg.kv_events
    if kv.enabled or kv.listen or any("kv_events" in r.labels for r in cfg.replicas):
        from extproc.fleet.kvevents.cache_state import EventCacheState
        from extproc.observe.metrics.kv_events import KvEventMetrics
        from extproc.request.tokenizer import TokenizerError

        try:
            kv_events = EventCacheState(
                kv, metrics=KvEventMetrics(metrics.registry), max_blocks=cfg.features.max_blocks
            )
        except TokenizerError as exc:
            await store.close()
            raise ConfigError(f"kv_events.tokenizers: {exc}") from None
    try:
        tracer = DecisionTracer(cfg.tracing) if cfg.tracing.enabled else None
    except TracingUnavailable as exc:
        await store.close()
        raise ConfigError(str(exc)) from None
    # With Redis, every gateway's charges count against one budget.
    budget_store = RedisBudgetStore(store.client, store.keys.namespace) if isinstance(store, RedisStore) else None
    router = Router(cfg, store=store, metrics=metrics, kv_events=kv_events, tracer=tracer, budget_store=budget_store)
    if worker is not None:
        from extproc.fleet.health.shared_load import PeerLoad

        router.replicas.peers = PeerLoad(worker[1], worker[0].index, cfg.health.recent_half_life_s)
    if kv_events is not None:
        if not kv.enabled:
            logging.getLogger("extproc.fleet.kvevents").warning(
                "kv events: no --tokenizer (kv_events.tokenizers): events are indexed but no request matches them"
            )
        kv_events.start(cfg.replicas)
    # Every port is bound before any serves, the ext_proc port last (extproc.adapters.server.listeners):
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
            server=cfg.grpc.server,
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
        run_discovery(
            cfg.discovery, router.fleet, router.metrics, static=cfg.replicas, cluster_mode=cfg.mode == "cluster"
        ),
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
    log = logging.getLogger("extproc.state.budgets")
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
