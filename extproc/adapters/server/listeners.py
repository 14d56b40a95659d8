"""Every port the processor opens, all bound before any of them serves.

Two processors on one host that differ only in ``--listen`` and ``--metrics-listen`` once met on
a port neither had asked for; the second one's ext_proc port had already taken Envoy's
connections when it exited, and every request through that gateway failed. So start-up has two
phases. :func:`bind_all` binds each listener in turn and the first failure stops it: the ones
already bound are closed and :class:`BindError` names the address and what it was for, which
``extproc serve`` prints on one line before exiting non-zero. Only then does each start serving.

The ext_proc port binds last. A bound gRPC port listens at once (grpc binds and listens in
``add_*_port``: a client's TCP connect completes in the kernel's backlog, although nothing
answers before ``start()``), and the ext_proc port is the one Envoy dials: bound after every
other port, it never takes a connection for a processor that then fails to start.

The listeners: the metrics endpoint with the console (:class:`MetricsListener`), the admin API
when it has a port of its own (:class:`extproc.adapters.admin.server.AdminServer`), and the gRPC ports of
:class:`~extproc.adapters.server.app.ProcessorServer` (:class:`GrpcListener`: the plaintext health port,
then ext_proc). docs/ports.md has them in a table.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.adapters.metrics_http import metrics_app

log = logging.getLogger("extproc.adapters.server")
BACKLOG = 128


class BindError(Exception):
    """A listener could not bind; the message names its role and address."""

    def __init__(self, role: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address} ({role}): {reason}")
        self.role = role
        self.address = address


class Listener(Protocol):
    """One port the processor opens."""

    @property
    def role(self) -> str:
        """What the port is for, as :class:`BindError` names it."""

    @property
    def address(self) -> str:
        """Where it listens (once bound, with the real port when 0 was asked for)."""

    async def bind(self) -> None:
        """Take the address (bound, nothing served yet); raises :class:`BindError`."""

    async def start(self) -> None:
        """Start serving on the bound address."""

    async def close(self) -> None:
        """Stop serving and release the address (idempotent)."""


def is_loopback(listen: str) -> bool:
    """Whether ``listen`` (HOST:PORT or unix:/path) is reachable from this host only."""
    if listen.startswith("unix:"):
        return True  # a socket file: its permissions decide, not the network
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or empty (every interface)


class GrpcListener:
    """One port of a ``grpc.aio`` server (several may share a server).

    ``shared``: the port is shared with the other workers of one ``serve --workers`` (whose
    parent checked it was free), so it is not test-bound first: a worker's own port is taken.
    """

    def __init__(
        self,
        role: str,
        listen: str,
        server: grpc.aio.Server,
        credentials: grpc.ServerCredentials | None = None,
        grace_s: float = 0.5,
        shared: bool = False,
    ) -> None:
        self.role = role
        self.shared = shared
        self.listen = listen
        self.server = server
        self.credentials = credentials
        self.grace_s = grace_s
        self.port = 0
        self.address = listen
        """Where it listens; once bound, with the real port when 0 was asked for."""
        self._state = "new"  # new, bound, serving, closed

    def bind_now(self) -> None:
        """Bind (synchronously: grpc's ``add_*_port`` is); raises :class:`BindError`."""
        try:
            if not self.shared:
                try_bind(self.listen)
        except OSError as exc:
            raise BindError(self.role, self.listen, bind_failure(exc)) from None
        try:
            if self.credentials is not None:
                port = self.server.add_secure_port(self.listen, self.credentials)
            else:
                port = self.server.add_insecure_port(self.listen)
        except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
            raise BindError(self.role, self.listen, "address already in use or not available") from exc
        if port == 0 and not self.listen.startswith("unix:"):
            raise BindError(self.role, self.listen, "address already in use or not available")
        self.port, self._state = port, "bound"
        if not self.listen.startswith("unix:"):
            self.address = f"{self.listen.rpartition(':')[0]}:{port}"

    async def bind(self) -> None:
        """Bind; raises :class:`BindError`."""
        self.bind_now()

    async def start(self) -> None:
        """Start the server (once, whichever of its listeners asks first)."""
        if self._state == "bound":
            await self.server.start()
            self._state = "serving"

    async def close(self) -> None:
        """Stop the server within ``grace_s``."""
        if self._state == "bound":
            # grpc releases an unstarted server's ports only through start and stop.
            await self.server.start()
        if self._state in ("bound", "serving"):
            self._state = "closed"
            await self.server.stop(self.grace_s)


class MetricsListener:
    """``/metrics`` and ``/healthz`` over HTTP (:func:`~extproc.adapters.metrics_http.metrics_app`)."""

    role = "metrics"

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        before_scrape: Callable[[], None],
        extra: Callable[[web.Application], object] | None = None,
    ) -> None:
        self.registry = registry
        self.address = address
        self.before_scrape = before_scrape
        self.extra = extra  # more read-only routes on the same port (the console)
        self._runner: web.AppRunner | None = None
        self._sockets: list[socket.socket] = []

    async def bind(self) -> None:
        """Bind :attr:`address` and listen; requests are answered from :meth:`start` on."""
        try:
            self._sockets = await _listening_sockets(self.address)
        except (OSError, ValueError) as exc:
            raise BindError(self.role, self.address, bind_failure(exc)) from None
        if self.address.rpartition(":")[2] == "0":
            self.address = f"{self.address.rpartition(':')[0]}:{self._sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        """Serve the bound sockets."""
        if self._runner is not None or not self._sockets:
            return
        runner = web.AppRunner(metrics_app(self.registry, self.before_scrape, self.extra), access_log=None)
        await runner.setup()
        self._runner = runner
        for sock in self._sockets:
            await web.SockSite(runner, sock).start()
        self._sockets = []  # the sites own them now

    async def close(self) -> None:
        """Stop the HTTP server (or release the sockets it never served)."""
        for sock in self._sockets:
            sock.close()
        self._sockets = []
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


def try_bind(listen: str) -> None:
    """Bind a throwaway socket to ``listen`` (TCP, a fixed port) and release it: OSError if taken.

    Only so that a port in use is reported on one line of ours: grpc, finding it taken, also
    logs an error of its own (which it still does if another process takes the port between)."""
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return  # a form grpc resolves itself (dns:, ...): its add_port decides
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)


async def _listening_sockets(address: str) -> list[socket.socket]:
    """Sockets bound to ``address`` (HOST:PORT, every address HOST resolves to) and listening.

    Listening now, not at start: two processors starting together on one port would otherwise
    both bind (SO_REUSEADDR lets sockets that are not listening share an address) and the
    second would only fail once serving."""
    host, port = _host_port(address)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return listen_on(infos, port)


def listening_sockets(address: str, reuse_port: bool = False) -> list[socket.socket]:
    """:func:`_listening_sockets` for a caller not on the event loop (the name resolved
    synchronously); ``reuse_port``: SO_REUSEPORT, a port the workers of one ``serve --workers``
    share."""
    host, port = _host_port(address)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return listen_on(infos, port, reuse_port)


def _host_port(address: str) -> tuple[str | None, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ValueError("expected HOST:PORT")
    return host.strip("[]") or None, int(port_text)


def listen_on(infos: Sequence[tuple[Any, ...]], port: int, reuse_port: bool = False) -> list[socket.socket]:
    """A socket bound and listening on each of ``infos`` (getaddrinfo's results), on ``port``
    (0: the port the first one got, for them all); every one closed if any fails."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((sockaddr[0], port, *sockaddr[2:]))
            sock.listen(BACKLOG)
            port = sock.getsockname()[1]  # asked for 0: the other families on the port the first got
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_failure(exc: BaseException) -> str:
    """What went wrong binding, in a few words (the OS's reason, without its prefix)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.rpartition(": ")[2] or exc.strerror
    return str(exc)


async def bind_all(listeners: Sequence[Listener]) -> None:
    """Bind every listener in order; on the first failure close those bound and raise it."""
    bound: list[Listener] = []
    for listener in listeners:
        try:
            await listener.bind()
        except BindError:
            for done in reversed(bound):
                await done.close()
            raise
        bound.append(listener)


async def start_all(listeners: Sequence[Listener]) -> None:
    """Start serving on every (bound) listener, in order."""
    for listener in listeners:
        await listener.start()
        log.info("%s listening on %s", listener.role, listener.address)


async def close_all(listeners: Sequence[Listener]) -> None:
    """Close every listener, last bound first."""
    for listener in reversed(listeners):
        await listener.close()
