"""The ext_proc port on grpclib (``grpc.server: grpclib``): ext_proc and gRPC health, one thread.

grpcio's asyncio server hands every message across threads: its core's event engine reads the
socket and completes the call on a thread of its own, a poller thread takes the completion from
the completion queue and wakes the event loop, and only then does the handler run. grpclib speaks
HTTP/2 in Python on the event loop itself, so a message is read, decided and answered on one
thread. Measured through Envoy on fake replicas (docs/performance.md): a quarter more requests a
second at 8 KB prompts and less CPU a request, but fewer at 200 KB, where its Python framing costs
more than grpcio's C core; behind busy vLLM CPU engines, no difference beyond the runs' spread for
our processor. So it is a choice, not the default.

What it serves: the ext_proc service and gRPC health (``grpc.health.v1``, the same statuses as
the grpcio server reports), also on ``grpc.health_listen``. Not reflection, and not the admin API
on the ext_proc port (give it ``admin.listen``). TLS from ``grpc.tls`` or the self-signed
certificate of ``grpc.secure_serving``; a failed handshake is asyncio's to log, not counted.
grpclib has no message size limit, so ``grpc.max_message_bytes`` does not apply: Envoy's buffer
limit bounds the body it sends, and ``request.max_body_bytes`` what is parsed.
On stop, streams in flight get ``grace_s`` to finish while the port still accepts (health
reports NOT_SERVING first), then the rest are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from extproc.adapters.server.listeners import BACKLOG, BindError, bind_failure, listening_sockets
from extproc.adapters.server.tls import WatchedFiles, read_pem
from extproc.config import ListenerTls

PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_PATH = "/grpc.health.v1.Health/Watch"
ServeStream = Callable[
    [AsyncIterator[pb.ProcessingRequest], Callable[[pb.ProcessingResponse], Awaitable[None]], Any],
    Awaitable[None],
]
"""One ext_proc stream served: requests, a write, the stream's metadata
(:meth:`~extproc.adapters.server.servicer.ExternalProcessor.serve`)."""


class Health:
    """gRPC health's statuses by service name, set as on grpcio's servicer (``await set(name,
    status)``) and served to grpclib's streams: Check answers NOT_FOUND for a name never set,
    Watch sends SERVICE_UNKNOWN for it and every change after."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()

    async def set(self, name: str, status: int) -> None:
        """Report ``status`` for ``name`` (the whole server's with ``""``)."""
        self._status[name] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def check(self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]) -> None:
        """``Health/Check``."""
        request = await stream.recv_message()
        status = self._status.get(request.service if request is not None else "")
        if status is None:
            raise GRPCError(Status.NOT_FOUND, "unknown service")
        await stream.send_message(health_pb2.HealthCheckResponse(status=status))

    async def watch(self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]) -> None:
        """``Health/Watch``: the status now, then each change, until the client goes."""
        request = await stream.recv_message()
        name = request.service if request is not None else ""
        sent: int | None = None
        while True:
            changed = self._changed
            status = self._status.get(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != sent:
                await stream.send_message(health_pb2.HealthCheckResponse(status=status))
                sent = status
            await changed.wait()

    def __mapping__(self) -> dict[str, Handler]:
        request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        return {
            HEALTH_CHECK_PATH: Handler(self.check, Cardinality.UNARY_UNARY, request, response),
            HEALTH_WATCH_PATH: Handler(self.watch, Cardinality.UNARY_STREAM, request, response),
        }


class ExtProc:
    """The ext_proc service for grpclib: each stream served by ``serve``; counts the streams in
    flight, which a graceful stop waits for."""

    def __init__(self, serve: ServeStream) -> None:
        self._serve = serve
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def process(self, stream: Stream[pb.ProcessingRequest, pb.ProcessingResponse]) -> None:
        """``ExternalProcessor/Process``."""
        self.in_flight += 1
        self._idle.clear()
        try:
            metadata = stream.metadata.items() if stream.metadata is not None else ()
            await self._serve(_reads(stream), stream.send_message, metadata)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def idle(self, timeout_s: float) -> None:
        """Return once no stream is in flight, or after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            PROCESS_PATH: Handler(self.process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse)
        }


async def _reads(stream: Stream[pb.ProcessingRequest, pb.ProcessingResponse]) -> AsyncIterator[pb.ProcessingRequest]:
    while (request := await stream.recv_message()) is not None:
        yield request


def _server_context() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["h2"])  # gRPC's clients (Envoy) insist on it
    return context


class SslContextFiles(WatchedFiles[ssl.SSLContext]):
    """``grpc.tls``'s files as grpclib's TLS, read again when one changes: checked at each
    handshake, a changed pair is served to the connections made after it, as on grpcio."""

    def __init__(self, tls: ListenerTls) -> None:
        super().__init__(tls)
        self.listening = self.configuration
        """The context the port listens with; each handshake may move to a newer one."""
        self.listening.sni_callback = self._handshake

    def _load(self) -> ssl.SSLContext:
        tls = self.tls
        read_pem(tls.cert_file, "cert_file")  # grpcio's checks and messages for a bad file
        read_pem(tls.key_file, "key_file")
        if tls.client_ca_file:
            read_pem(tls.client_ca_file, "client_ca_file")
        context = _server_context()
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file)
            if tls.client_ca_file:
                context.load_verify_locations(tls.client_ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"grpc.tls: {exc}") from None
        return context

    def _handshake(self, sslobj: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        self()
        if self.configuration is not self.listening:
            sslobj.context = self.configuration


def self_signed_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """TLS with a certificate and key in PEM (``grpc.secure_serving``'s, made at start)."""
    context = _server_context()
    # ssl loads a chain from files only; the pair lives in a private directory for the call.
    with tempfile.TemporaryDirectory(prefix="extproc-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context


class GrpclibListener:
    """One port served by grpclib: bound (and listening) first, served from :meth:`start`, on
    every address its host resolves to (as grpcio binds them), a grpclib server on each.

    ``shared``: the port is shared with the other workers of one ``serve --workers``
    (SO_REUSEPORT, their parent checked it was free).
    """

    def __init__(
        self,
        role: str,
        listen: str,
        services: Sequence[Health | ExtProc],
        context: ssl.SSLContext | None = None,
        grace_s: float = 0.5,
        shared: bool = False,
        ext_proc: ExtProc | None = None,
    ) -> None:
        self.role = role
        self.listen = listen
        self.services = list(services)
        self.context = context
        self.grace_s = grace_s
        self.shared = shared
        self.ext_proc = ext_proc
        """The ext_proc service on this port, whose streams a graceful stop waits for."""
        self.port = 0
        self.address = listen
        self._sockets: list[socket.socket] = []
        self._servers: list[Server] = []

    def bind_now(self) -> None:
        """Bind and listen; raises :class:`BindError`."""
        try:
            if self.listen.startswith("unix:"):
                self._sockets = [_unix_socket(self.listen[5:])]
            else:
                self._sockets = listening_sockets(self.listen, reuse_port=self.shared)
        except (OSError, ValueError) as exc:
            raise BindError(self.role, self.listen, bind_failure(exc)) from None
        if not self.listen.startswith("unix:"):
            self.port = self._sockets[0].getsockname()[1]
            self.address = f"{self.listen.rpartition(':')[0]}:{self.port}"

    async def bind(self) -> None:
        """Bind; raises :class:`BindError`."""
        self.bind_now()

    async def start(self) -> None:
        """Serve the bound sockets."""
        if self._servers:
            return
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            server = Server(self.services)
            await server.start(sock=sock, ssl=self.context)
            self._servers.append(server)

    async def close(self) -> None:
        """Let streams in flight finish within ``grace_s``, then stop (idempotent)."""
        sockets, self._sockets = self._sockets, []
        servers, self._servers = self._servers, []
        for sock in sockets:
            sock.close()
        if not servers:
            return
        if self.ext_proc is not None and self.grace_s > 0:
            await self.ext_proc.idle(self.grace_s)
        for server in servers:
            server.close()
        for server in servers:
            await server.wait_closed()


def _unix_socket(path: str) -> socket.socket:
    """A listening socket at ``path``, replacing a stale socket file (as grpcio does), never a
    file of another kind."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock
