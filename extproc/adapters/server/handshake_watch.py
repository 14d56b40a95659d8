"""TLS handshakes that fail on our ports, counted and told within seconds.

A gateway that speaks plaintext to the picker's TLS port never reaches Python: gRPC's core closes
the connection during the handshake, and the gateway sees only "connection closed" (with
FailOpen, silently Envoy's own pick). The core does say so, in one line of its own log at its
INFO level (``Handshake failed with error SSL_ERROR_SSL: ... WRONG_VERSION_NUMBER``), written to
the process's standard error. So at start the process's stderr is read through a pipe: the core's
INFO lines are dropped (they are not for production logs), a handshake failure is counted
(``extproc_tls_handshake_failures_total{reason}``) and logged as a warning naming the likely
cause, and every other line goes on to the real stderr unchanged.

The reverse (a gateway speaking TLS to a plaintext port) the core logs only with its HTTP/2
tracing on, which is too costly to leave on; the gateway's side reports it (Envoy's
``ssl.connection_error`` on the picker's cluster).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("extproc.adapters.server.tls")

# gRPC core's log lines: a severity letter, MMDD, time, thread, file:line] message.
_CORE_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\] (.*)$")
_HANDSHAKE = re.compile(rb"Handshake failed with error (\w+): (.*)")
# What a failed handshake's OpenSSL reason most likely means on a server port.
CAUSES = {
    "WRONG_VERSION_NUMBER": "a client speaking plaintext to this TLS port (the gateway's cluster for the picker "
    "needs TLS, a transport_socket; or serve plaintext with --secure-serving=false and no certificate)",
    "HTTP_REQUEST": "a client sending plain HTTP/1 to this TLS port",
    "NO_SHARED_CIPHER": "a client with no cipher in common",
    "CERTIFICATE_VERIFY_FAILED": "a client certificate the configured CA did not sign (mutual TLS)",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "a client without a certificate on a mutual-TLS port",
    "TLSV1_ALERT_UNKNOWN_CA": "a client that does not trust this port's certificate",
}
REPORT_EVERY_S = 10.0


def reason_of(message: bytes) -> str:
    """The OpenSSL reason of a handshake failure line (``WRONG_VERSION_NUMBER``), or ``other``."""
    for reason in CAUSES:
        if reason.encode() in message:
            return reason
    return "other"


class HandshakeWatch:
    """Reads the process's stderr for gRPC core's handshake failures (see the module's doc).

    ``failed(reason)`` is called for each failure, from the watch's thread. The first failure of a
    reason is logged at once, later ones at most every ``report_every_s`` as a count.
    """

    def __init__(self, failed: Callable[[str], None], report_every_s: float = REPORT_EVERY_S) -> None:
        self.failed = failed
        self.report_every_s = report_every_s
        self._out = -1
        self._thread: threading.Thread | None = None
        self._reported: dict[str, tuple[float, int]] = {}

    def start(self) -> bool:
        """Route stderr through the watch, and say whether it did; call before the first gRPC
        server or channel is made (gRPC's core reads its log level then). A process whose stderr
        is already redirected in Python (a test harness capturing it, ``main`` called in-process)
        is left alone."""
        if sys.stderr is not sys.__stderr__ or self._thread is not None:
            return False
        os.environ["GRPC_VERBOSITY"] = "INFO"
        read, write = os.pipe()
        self._out = os.dup(2)
        # Python's own writes (logging, tracebacks) go straight to the real stderr, never through
        # the pipe: only the core's native writes to fd 2 are read, and the watch's own warnings
        # cannot block on the pipe it drains.
        stream = os.fdopen(self._out, "w", buffering=1, closefd=False)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                handler.setStream(stream)
        sys.stderr = stream
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="handshake-watch", daemon=True)
        self._thread.start()
        return True

    def _pump(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as source:
            pending = b""
            while chunk := source.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._safely(line)
            if pending:
                self._safely(pending)

    def _safely(self, line: bytes) -> None:
        # The pump must never stop: every writer to stderr would block once the pipe filled.
        try:
            self.line(line)
        except Exception:
            with contextlib.suppress(OSError):
                self._write(line + b"\n")

    def line(self, line: bytes) -> None:
        """One line of stderr: passed on, dropped (the core's INFO) or read as a handshake failure."""
        core = _CORE_LINE.match(line)
        if core is None or core[1] != b"I":
            self._write(line + b"\n")
            return
        failure = _HANDSHAKE.search(core[2])
        if failure is not None:
            reason = reason_of(failure[2])
            with contextlib.suppress(Exception):  # a metrics failure must never stop stderr from flowing
                self.failed(reason)
            self._report(reason)

    def _report(self, reason: str) -> None:
        now = time.monotonic()
        since, count = self._reported.get(reason, (-1e18, 0))
        count += 1
        if now - since >= self.report_every_s:
            cause = CAUSES.get(reason, "a client whose TLS does not match this port's")
            log.warning(
                "TLS handshake failed on a TLS port of this router (%s): most likely %s; %d such failure(s) "
                "in the last %.0fs (extproc_tls_handshake_failures_total)",
                reason,
                cause,
                count,
                self.report_every_s,
            )
            self._reported[reason] = (now, 0)
        else:
            self._reported[reason] = (since, count)

    def _write(self, data: bytes) -> None:
        if self._out < 0:
            return
        view = memoryview(data)
        with contextlib.suppress(OSError):  # the real stderr closed: the line has nowhere to go
            while view:
                view = view[os.write(self._out, view) :]


def watch_handshakes(failures: Any, tls_served: bool) -> HandshakeWatch | None:
    """Where a port serves TLS, start a watch counting each failure in ``failures`` (a Prometheus
    counter labelled by ``reason``). Call it before any gRPC server or channel is made: gRPC's core
    reads its log level then."""
    if not tls_served:
        return None
    watch = HandshakeWatch(lambda reason: failures.labels(reason).inc())
    watch.start()
    return watch
