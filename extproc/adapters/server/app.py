"""The gRPC server: ext_proc, the standard health service and reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from extproc.adapters.server.envoy_check import EnvoyConfigCheck
from extproc.adapters.server.listeners import GrpcListener, is_loopback
from extproc.adapters.server.servicer import ExternalProcessor
from extproc.adapters.server.tls import WatchedFiles, server_credentials
from extproc.app.router import Router
from extproc.config import ListenerTls

if TYPE_CHECKING:
    from extproc.adapters.server.grpclib_server import GrpclibListener

log = logging.getLogger("extproc.adapters.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The names GIE's inferencepool chart probes its picker by: readiness as the ext_proc service's,
# liveness as the process's (so our image serves in its place with the chart's probes unchanged).
PICKER_READINESS = ("inference-extension", "readiness")
PICKER_LIVENESS = ("liveness",)

Service = Callable[[grpc.aio.Server], str]
"""Adds one more servicer to the ext_proc port's server and returns its full name (for reflection)."""


class HealthStatuses(Protocol):
    """gRPC health's statuses, as both servers' health services take them."""

    async def set(self, name: str, status: int) -> None:
        """Report ``status`` (``HealthCheckResponse.ServingStatus``) for the service ``name``."""


class ProcessorServer:
    """A running ext_proc server bound to one address.

    Its ports are :attr:`listeners`, the plaintext health port (with ``health_listen``) first and
    ext_proc last: bound when it is built, or with ``bind=False`` by the caller
    (:func:`~extproc.adapters.server.listeners.bind_all`, after the processor's other listeners), so that
    the ext_proc port is taken only once every other port is. ``services`` share the ext_proc
    port (the admin API by default).

    ``server`` is ``grpc.server``: grpcio, or grpclib (ext_proc and health only,
    :mod:`extproc.adapters.server.grpclib_server`).

    A processor does not share its ports with another process (a second one on the same port
    fails to start, rather than silently take half the traffic), except with ``reuse_port``: the
    workers of one ``extproc serve --workers N``, whose parent checked the ports were free and
    holds them (:mod:`extproc.adapters.server.workers`).
    """

    def __init__(
        self,
        router: Router,
        listen: str,
        max_message_bytes: int = 32 * 1024 * 1024,
        tls: ListenerTls | None = None,
        health_listen: str | None = None,
        services: Sequence[Service] = (),
        bind: bool = True,
        reuse_port: bool = False,
        self_signed: bool = False,
        server: str = "grpcio",
    ) -> None:
        self.router = router
        self.listen = listen
        self.tls = tls
        self.self_signed_cert: bytes | None = None
        """The certificate made at start (``self_signed`` without ``tls``), PEM."""
        self.certificates: WatchedFiles[Any] | None = None
        # What the streams show of Envoy's ext_proc filter: a body mode that cannot route fails
        # readiness (extproc.adapters.server.envoy_check).
        self.envoy_check = EnvoyConfigCheck(router.clock, router.metrics.config_problem_seen)
        self._discovered = True
        self._config_ok = True
        self._checking: asyncio.Task[None] | None = None
        self._readiness: asyncio.Task[None] | None = None
        self.health: HealthStatuses
        self.ext_proc: GrpcListener | GrpclibListener
        self.health_listener: GrpcListener | GrpclibListener | None = None
        self.listeners: list[GrpcListener | GrpclibListener] = []
        self.services: list[str] = []
        servicer = ExternalProcessor(router, self.envoy_check)
        if not tls and not self_signed and not is_loopback(listen):
            # Anything that reaches a plaintext listener can have requests routed and hold
            # in-flight slots; off loopback that wants TLS or a network policy in front.
            log.warning("ext_proc listener %s is not loopback and has no TLS (see grpc.tls)", listen)
        self.kind = server
        if server == "grpclib":
            if services:
                raise ValueError(
                    "grpc.server grpclib serves ext_proc and health only: the admin API needs admin.listen"
                )
            self._on_grpclib(servicer, listen, tls, self_signed, health_listen, reuse_port)
        else:
            self._on_grpcio(servicer, listen, max_message_bytes, tls, self_signed, health_listen, services, reuse_port)
        self.listeners = [*([self.health_listener] if self.health_listener is not None else []), self.ext_proc]
        if bind:
            for listener in self.listeners:
                listener.bind_now()

    def _on_grpcio(
        self,
        servicer: ExternalProcessor,
        listen: str,
        max_message_bytes: int,
        tls: ListenerTls | None,
        self_signed: bool,
        health_listen: str | None,
        services: Sequence[Service],
        reuse_port: bool,
    ) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", int(reuse_port)),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        self.health = health_servicer
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        self.services = [add(server) for add in services]
        names = (SERVICE_NAME, HEALTH_SERVICE_NAME, *self.services, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        credentials = None
        if tls is not None:
            credentials, self.certificates = server_credentials(tls)  # ValueError names a bad file
        elif self_signed:
            from extproc.adapters.server.self_signed import self_signed_credentials

            credentials, self.self_signed_cert = self_signed_credentials()
        self.ext_proc = GrpcListener("ext_proc", listen, server, credentials, shared=reuse_port)
        if health_listen is not None:
            # Health alone, in plaintext: the same servicer, so both ports report the same status.
            health_server = grpc.aio.server(options=[("grpc.so_reuseport", int(reuse_port))])
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
            self.health_listener = GrpcListener(
                "gRPC health", health_listen, health_server, grace_s=0, shared=reuse_port
            )

    def _on_grpclib(
        self,
        servicer: ExternalProcessor,
        listen: str,
        tls: ListenerTls | None,
        self_signed: bool,
        health_listen: str | None,
        reuse_port: bool,
    ) -> None:
        from extproc.adapters.server import grpclib_server as lib

        statuses = lib.Health()
        self.health = statuses
        context = None
        if tls is not None:
            files = lib.SslContextFiles(tls)  # ValueError names a bad file
            self.certificates, context = files, files.listening
        elif self_signed:
            from extproc.adapters.server.self_signed import self_signed_pair

            cert, key = self_signed_pair()
            self.self_signed_cert, context = cert, lib.self_signed_context(cert, key)
        ext_proc = lib.ExtProc(servicer.serve)
        self.ext_proc = lib.GrpclibListener(
            "ext_proc", listen, [ext_proc, statuses], context, shared=reuse_port, ext_proc=ext_proc
        )
        if health_listen is not None:
            self.health_listener = lib.GrpclibListener(
                "gRPC health", health_listen, [statuses], grace_s=0, shared=reuse_port
            )

    @property
    def port(self) -> int:
        """The ext_proc port (the real one when 0 was asked for)."""
        return self.ext_proc.port

    @property
    def health_port(self) -> int:
        """The plaintext health port, 0 without one."""
        return self.health_listener.port if self.health_listener is not None else 0

    @property
    def address(self) -> str:
        """Where the server listens, with the real port when 0 was asked for."""
        if self.listen.startswith("unix:"):
            return self.listen
        host = self.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self, ready_when: Callable[[], bool] | None = None, ready_timeout_s: float = 10.0) -> None:
        """Start serving and report SERVING on the health service.

        With ``ready_when`` (discovery that has not listed any replica yet) the ext_proc service
        reports NOT_SERVING until it holds, or until ``ready_timeout_s`` has passed: a readiness
        probe then waits for the first list rather than send traffic down Envoy's default route,
        and a discovery that never answers still ends in SERVING (Envoy fails open anyway).
        """
        for listener in self.listeners:  # ext_proc last
            await listener.start()
        for name in ("", *PICKER_LIVENESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._discovered = ready_when is None or ready_when()
        await self._set_readiness()
        if not self._discovered:
            assert ready_when is not None
            self._readiness = asyncio.create_task(self._serving_when(ready_when, ready_timeout_s))
        self._checking = asyncio.create_task(self._check_envoy(), name="envoy-check")
        security = (
            ("TLS, self-signed" if self.self_signed_cert else "plaintext")
            if self.tls is None
            else "mutual TLS"
            if self.tls.mutual
            else "TLS"
        )
        also = "".join(f"; also {name}" for name in self.services)
        if self.kind == "grpclib":
            security += ", on grpclib"
        log.info(
            "ext_proc server listening on %s (mode %s, %s%s)", self.address, self.router.config.mode, security, also
        )

    async def _serving_when(self, ready: Callable[[], bool], timeout_s: float) -> None:
        world = self.router.world
        deadline = world.monotonic() + timeout_s
        while not ready():
            if world.monotonic() >= deadline:
                log.warning("no replica discovered after %.0fs: reporting SERVING (Envoy routes by default)", timeout_s)
                break
            await world.sleep(0.1)
        self._discovered = True
        await self._set_readiness()

    async def _set_readiness(self) -> None:
        """The ext_proc service is ready once discovery listed replicas and while Envoy's ext_proc
        configuration shows no problem."""
        serving = self._discovered and self._config_ok
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (SERVICE_NAME, *PICKER_READINESS):
            await self.health.set(name, status)

    async def _check_envoy(self, every_s: float = 1.0) -> None:
        """Judge what the streams showed of Envoy's ext_proc configuration, every second."""
        while True:
            await self.router.world.sleep(every_s)
            ok = self.envoy_check.evaluate()
            if ok != self._config_ok:
                self._config_ok = ok
                await self._set_readiness()

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING first, so probes drain traffic, then stop within ``grace`` seconds."""
        for task in (self._readiness, self._checking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for name in ("", SERVICE_NAME, *PICKER_READINESS, *PICKER_LIVENESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.ext_proc.grace_s = grace
        await self.ext_proc.close()
        if self.health_listener is not None:
            await self.health_listener.close()
        await self.router.store.close()

    async def serve_until_signalled(self, grace: float = 5.0, ready_when: Callable[[], bool] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        await self.start(ready_when)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down (grace %.1fs)", grace)
        await self.stop(grace)
