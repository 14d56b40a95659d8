"""``extproc serve --workers N``: N processes serving one ext_proc port, sharing state in memory.

The parent binds nothing it serves. It checks that the ext_proc port (and the gRPC health port)
is free exactly as a single processor does, then holds a bound, non-listening SO_REUSEPORT socket
on it for its lifetime: its own workers join the port, while another processor (which never sets
SO_REUSEPORT) or another ``serve --workers`` (whose check finds the port held) fails to start
with the usual "address in use". It creates the shared segment
(:mod:`extproc.state.shared_segment`), starts the workers (``spawn``: no gRPC state is ever
forked), and forwards SIGTERM and SIGINT to them. A worker that exits on its own stops the rest
and the parent exits non-zero, with the worker's code when it was a start-up failure (2 config,
3 port): a supervisor (systemd, Kubernetes) restarts the whole set, as it would one processor.
The segment is unlinked when the parent exits.

Ports of a worker's own (``/metrics``, a separate admin listener) are the configured port plus
the worker's index: each worker's counters are its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

from extproc.adapters.server.listeners import BindError, bind_failure, try_bind
from extproc.config import Config
from extproc.state.shared_segment import SegmentSize, SharedSegment
from extproc.state.store_url import parse_store_url

log = logging.getLogger("extproc.adapters.server")

MIN_REPLICA_ROWS = 16


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """What one worker is told by the parent (picklable: it crosses ``spawn``)."""

    index: int
    count: int
    segment: str
    lock: Any
    listen: str
    health_listen: str | None

    def flags(self, cfg: Config) -> list[str]:
        """The ``serve`` flags that make ``cfg`` this worker's: the shared ports as the parent
        resolved them, its own ports offset by its index."""
        out = ["--listen", self.listen]
        if self.health_listen is not None:
            out += ["--grpc-health-listen", self.health_listen]
        if cfg.metrics.address:
            out += ["--metrics-listen", offset_port(cfg.metrics.address, self.index)]
        if cfg.admin.enabled and cfg.admin.listen is not None and cfg.admin.listen != cfg.listen:
            out += ["--admin-listen", offset_port(cfg.admin.listen, self.index)]
        return out


def offset_port(listen: str, by: int) -> str:
    """``HOST:PORT`` with the port plus ``by`` (port 0 stays 0: each worker gets its own)."""
    host, _, port = listen.rpartition(":")
    return listen if not port.isdigit() or int(port) == 0 else f"{host}:{int(port) + by}"


def check_workers(cfg: Config) -> str | None:
    """Why ``cfg`` cannot run with several workers, None when it can."""
    if cfg.listen.startswith("unix:") or (cfg.grpc.health_listen or "").startswith("unix:"):
        return "workers: a unix socket cannot be shared by several processes; listen on HOST:PORT"
    if cfg.kv_events.listen:
        return "workers: kv_events.listen binds one endpoint; with several workers let each connect (kv_events)"
    if _has_budgets(cfg) and cfg.store.startswith("memory:"):
        # Each worker would count apart: the effective budget N times the configured one.
        return (
            f"workers: token budgets with the memory store would be counted by each of the {cfg.workers} workers "
            "apart (each budget times the workers); give a shared store (store: redis://...) or run one worker"
        )
    return None


def _has_budgets(cfg: Config) -> bool:
    b = cfg.budgets
    return b.enabled and bool(b.tenants or b.keys or b.models)


def budget_sharing(cfg: Config) -> str | None:
    """What the workers' budgets are counted in, for the start's log (None: no budgets)."""
    if not cfg.budgets.enabled:
        return None
    if not _has_budgets(cfg):
        return "budgets: metering only; each worker counts its own tokens (its usage export is its own)"
    store = parse_store_url(cfg.store).redacted
    return f"budgets: the {cfg.workers} workers charge one count per budget in the shared store {store}"


def hold_port(role: str, listen: str) -> tuple[socket.socket, str]:
    """Check ``listen`` is free, then hold it for our workers; returns the socket and the address
    with its real port. Raises :class:`BindError`."""
    host, _, port = listen.rpartition(":")
    try:
        try_bind(listen)
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
    except (OSError, ValueError) as exc:
        raise BindError(role, listen, bind_failure(exc)) from None
    return sock, f"{host}:{sock.getsockname()[1]}"


def segment_size(cfg: Config, workers: int) -> SegmentSize:
    """The shared tables for ``cfg``: pins and a prefix index only with the memory store (Redis
    keeps them otherwise), replica rows for twice the static replicas, at least
    :data:`MIN_REPLICA_ROWS`."""
    replicas = max(MIN_REPLICA_ROWS, 2 * len(cfg.replicas))
    if cfg.store.startswith("memory:"):
        return SegmentSize.for_config(cfg.sessions.max_sessions, cfg.prefix.blocks_per_replica, replicas, workers)
    return SegmentSize(replicas, 16, 16, workers)


def supervise(cfg: Config, target: Callable[[Sequence[str], WorkerSlot], None], argv: Sequence[str]) -> int:
    """Run ``cfg.workers`` workers, each ``target(argv, slot)`` in a spawned process, until a
    signal (0) or until one exits on its own (its code if it failed to start, else 1)."""
    count = cfg.workers
    held = []
    try:
        sock, listen = hold_port("ext_proc", cfg.listen)
        held.append(sock)
        health_listen = None
        if cfg.grpc.health_listen is not None:
            sock, health_listen = hold_port("gRPC health", cfg.grpc.health_listen)
            held.append(sock)
    except BindError:
        for sock in held:
            sock.close()
        raise
    ctx = multiprocessing.get_context("spawn")
    size = segment_size(cfg, count)
    segment = SharedSegment.create(size, ctx.Lock())
    log.info("%d workers on %s, sharing %s (%.1f MiB)", count, listen, segment.name, size.nbytes / 2**20)
    if (sharing := budget_sharing(cfg)) is not None:
        log.info("%s", sharing)
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    processes = []
    try:
        for i in range(count):
            slot = WorkerSlot(i, count, segment.name, segment.lock, listen, health_listen)
            process = ctx.Process(target=target, args=(list(argv), slot), name=f"extproc-worker-{i}")
            process.start()
            processes.append(process)
        code = 0
        while not stopping:
            ended = wait([p.sentinel for p in processes], timeout=0.5)
            if ended and not stopping:
                dead = next(p for p in processes if p.sentinel in ended)
                dead.join()
                exitcode = dead.exitcode or 0
                log.error("%s exited (code %s): stopping the other workers", dead.name, exitcode)
                code = exitcode if exitcode in (2, 3) else 1
                break
        return code
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: a worker drains within grpc.grace_s
        for process in processes:
            process.join(cfg.grpc.grace_s + 5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        segment.close()
        for sock in held:
            sock.close()
