"""Where the admin API is served: the ext_proc port by default, or a port of its own.

On the ext_proc port it is one more gRPC service on the same server (with ``grpc.tls`` when
that is on), so a second processor on the host needs no admin port of its own and cannot
collide on one. Off loopback that port is reached by whatever reaches Envoy's processor, so
there the admin API is served only with ``admin.token_file``, and every call, reading too,
needs the token (:class:`~extproc.adapters.admin.auth.MutationPolicy`); a client certificate on the
ext_proc port (Envoy's) authorises nothing. ``admin.listen`` gives it a port of its own
(:class:`AdminServer`, with ``admin.tls``), where reading stays open as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.adapters.admin.auth import MutationPolicy, read_token
from extproc.adapters.admin.service import AdminService
from extproc.adapters.server.app import Service
from extproc.adapters.server.listeners import GrpcListener, Listener, is_loopback
from extproc.adapters.server.tls import server_credentials
from extproc.app.router import Router
from extproc.config import AdminSettings

log = logging.getLogger("extproc.adapters.admin")
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminServer:
    """The admin API on ``settings.listen``, a port of its own: a
    :class:`~extproc.adapters.server.listeners.Listener`, bound with the others before any serves."""

    role = "admin"

    def __init__(self, router: Router, settings: AdminSettings) -> None:
        if settings.listen is None:
            raise ValueError("admin: no listen address")
        if settings.listen == router.config.listen:
            raise ValueError(f"admin.listen {settings.listen}: that is the ext_proc listener")
        self.listen = settings.listen
        self.settings = settings
        token = read_token(settings.token_file) if settings.token_file else None  # TokenFileError is a ValueError
        self.policy = MutationPolicy(token, settings.tls is not None and settings.tls.mutual)
        credentials = None
        if settings.tls is not None:
            credentials, self.certificates = server_credentials(settings.tls)  # ValueError names a bad file
        self.service = AdminService(router, self.policy, settings.watch_sample_rate)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_AdminServicer_to_server(self.service, server)
        self._port = GrpcListener(self.role, self.listen, server, credentials)

    @property
    def address(self) -> str:
        """Where it listens; once bound, with the real port when 0 was asked for."""
        return self._port.address

    @property
    def port(self) -> int:
        """The bound port (0 before :meth:`bind`)."""
        return self._port.port

    async def bind(self) -> None:
        """Bind; raises :class:`~extproc.adapters.server.listeners.BindError`."""
        await self._port.bind()

    async def start(self) -> None:
        """Serve on the bound port."""
        await self._port.start()
        if self._port.credentials is None and not is_loopback(self.listen):
            log.warning("admin listener %s is not loopback and has no TLS: its token travels in clear", self.listen)
        mutations = "mTLS" if self.policy.mutual_tls else "bearer token" if self.policy.token else "refused"
        log.info("admin API on %s (mutations: %s)", self.address, mutations)

    async def close(self, grace: float = 0.5) -> None:
        """Stop; open WatchDecisions streams are cancelled (idempotent)."""
        self._port.grace_s = grace
        await self._port.close()


def on_ext_proc_port(router: Router) -> Service | None:
    """The admin API as a service of the ext_proc port, or None where it must not be served.

    Loopback (or a unix socket): as on a port of its own, reading open, mutations with the
    token. Off loopback: only with the token, which every call then needs; without it the admin
    API is off, and a warning says how to have it."""
    cfg = router.config
    settings = cfg.admin
    token = read_token(settings.token_file) if settings.token_file else None  # TokenFileError is a ValueError
    local = is_loopback(cfg.listen)
    if not local and token is None:
        log.warning(
            "admin API not served: the ext_proc listener %s is not loopback and admin.token_file is not set "
            "(set it, or give the admin API a loopback port of its own: admin.listen / --admin-listen)",
            cfg.listen,
        )
        return None
    if not local and cfg.grpc.tls is None:
        log.warning("admin API on %s, not loopback and without TLS: its token travels in clear", cfg.listen)
    policy = MutationPolicy(token, mutual_tls=False, reads_need_token=not local)
    service = AdminService(router, policy, settings.watch_sample_rate)

    def add(server: grpc.aio.Server) -> str:
        pb_grpc.add_AdminServicer_to_server(service, server)
        return ADMIN_SERVICE_NAME

    reads = "bearer token" if policy.reads_need_token else "open"
    mutations = "bearer token" if token else "refused"
    log.info("admin API on the ext_proc port (reading: %s, mutations: %s)", reads, mutations)
    return add


@dataclass(frozen=True, slots=True)
class AdminPlacement:
    """Where :func:`place_admin` put the admin API: a listener of its own, or a service of the
    ext_proc port, or neither (off)."""

    listeners: list[Listener] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)


def place_admin(router: Router) -> AdminPlacement:
    """The admin API as ``router.config.admin`` asks: ValueError for a bad token or certificate
    file. ``admin.listen`` equal to the ext_proc listener means the ext_proc port."""
    cfg = router.config
    if not cfg.admin.enabled:
        return AdminPlacement()
    if cfg.admin.listen is not None and cfg.admin.listen != cfg.listen:
        return AdminPlacement(listeners=[AdminServer(router, cfg.admin)])
    if cfg.admin.tls is not None:
        raise ValueError("admin.tls: TLS of a separate admin listener, so set admin.listen too (see docs/ports.md)")
    service = on_ext_proc_port(router)
    return AdminPlacement(services=[service] if service is not None else [])
