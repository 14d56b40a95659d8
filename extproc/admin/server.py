"""The admin API's own gRPC listener, apart from ext_proc (``--admin-listen``)."""

from __future__ import annotations

import logging

import grpc

from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.admin.auth import MutationPolicy, read_token
from extproc.admin.service import AdminService
from extproc.config import AdminSettings
from extproc.router import Router
from extproc.server.tls import server_credentials

log = logging.getLogger("extproc.admin")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class AdminServer:
    """The admin API bound to ``settings.listen``."""

    def __init__(self, router: Router, settings: AdminSettings) -> None:
        if settings.listen is None:
            raise ValueError("admin: no listen address")
        if settings.listen == router.config.listen:
            raise ValueError(f"admin.listen {settings.listen}: that is the ext_proc listener")
        self.listen = settings.listen
        token = read_token(settings.token_file) if settings.token_file else None  # TokenFileError is a ValueError
        mutual = settings.tls is not None and settings.tls.mutual
        self.policy = MutationPolicy(token, mutual)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_AdminServicer_to_server(AdminService(router, self.policy, settings.watch_sample_rate), self.server)
        if settings.tls is not None:
            credentials, self.certificates = server_credentials(settings.tls)
            self.port = self.server.add_secure_port(self.listen, credentials)
        else:
            self.port = self.server.add_insecure_port(self.listen)
        if self.port == 0 and not self.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {self.listen}")
        host = self.listen.rpartition(":")[0]
        if settings.tls is None and not self.listen.startswith("unix:") and host not in LOOPBACK_HOSTS:
            log.warning("admin listener %s is not loopback and has no TLS: its token travels in clear", self.listen)

    @property
    def address(self) -> str:
        """Where it listens, with the real port when 0 was asked for."""
        if self.listen.startswith("unix:"):
            return self.listen
        return f"{self.listen.rpartition(':')[0]}:{self.port}"

    async def start(self) -> None:
        """Start serving."""
        await self.server.start()
        mutations = "mTLS" if self.policy.mutual_tls else "bearer token" if self.policy.token else "refused"
        log.info("admin API listening on %s (mutations: %s)", self.address, mutations)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop; open WatchDecisions streams are cancelled."""
        await self.server.stop(grace)
