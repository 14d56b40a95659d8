"""The admin API's own gRPC listener, apart from ext_proc (``--admin-listen``)."""

from __future__ import annotations

import logging

import grpc

from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.admin.auth import MutationPolicy, read_token
from extproc.admin.service import AdminService
from extproc.config import AdminSettings
from extproc.router import Router
from extproc.server.listeners import BindError
from extproc.server.tls import server_credentials

log = logging.getLogger("extproc.admin")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class AdminServer:
    """The admin API on ``settings.listen``: a :class:`~extproc.server.listeners.Listener`, bound
    with the others before the processor reports SERVING."""

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
        self.credentials = None
        if settings.tls is not None:
            self.credentials, self.certificates = server_credentials(settings.tls)  # ValueError names a bad file
        self.service = AdminService(router, self.policy, settings.watch_sample_rate)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.address = self.listen
        """Where it listens; once bound, with the real port when 0 was asked for."""

    async def bind(self) -> None:
        """Bind and start serving; raises :class:`~extproc.server.listeners.BindError`."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_AdminServicer_to_server(self.service, server)
        try:
            if self.credentials is not None:
                port = server.add_secure_port(self.listen, self.credentials)
            else:
                port = server.add_insecure_port(self.listen)
        except RuntimeError as exc:  # grpc raises when the port is taken
            raise BindError(self.role, self.listen, str(exc)) from None
        if port == 0 and not self.listen.startswith("unix:"):
            raise BindError(self.role, self.listen, "address in use or unavailable")
        self.port, self.server = port, server
        if not self.listen.startswith("unix:"):
            self.address = f"{self.listen.rpartition(':')[0]}:{port}"
        await server.start()
        host = self.listen.rpartition(":")[0]
        if self.credentials is None and not self.listen.startswith("unix:") and host not in LOOPBACK_HOSTS:
            log.warning("admin listener %s is not loopback and has no TLS: its token travels in clear", self.listen)
        mutations = "mTLS" if self.policy.mutual_tls else "bearer token" if self.policy.token else "refused"
        log.info("admin API listening on %s (mutations: %s)", self.address, mutations)

    async def close(self, grace: float = 0.5) -> None:
        """Stop; open WatchDecisions streams are cancelled (idempotent)."""
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace)
