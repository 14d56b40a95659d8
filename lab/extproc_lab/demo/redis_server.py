"""Local ``redis-server`` processes for tests, the demo and benchmarks: a plain server, a one-node
Cluster, and a Sentinel watching a server. Started in a :class:`ProcessGroup`, ended by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import redis

from extproc_lab.demo.processes import ProcessGroup, free_port, wait_for_port

HOST = "127.0.0.1"


def redis_binary() -> str:
    """The ``redis-server`` binary on PATH (Debian package ``redis-server``)."""
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("redis-server not found: apt-get install redis-server (make os-deps does this)")
    return found


class LocalRedis:
    """One redis-server on loopback (and a unix socket), with nothing persisted.

    ``cluster=True`` makes it a one-node Redis Cluster owning all 16384 slots: enough to check
    that every key a script touches is in one slot, which a plain server never checks.
    """

    def __init__(
        self,
        procs: ProcessGroup,
        directory: Path,
        name: str = "redis",
        port: int | None = None,
        cluster: bool = False,
        password: str | None = None,
    ) -> None:
        self.procs = procs
        self.dir = directory
        self.name = name
        self.port = port or free_port()
        self.cluster = cluster
        self.password = password
        self.socket_path = str(directory / f"{name}.sock")

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (``redis+cluster://`` for a cluster), without the password."""
        scheme = "redis+cluster" if self.cluster else "redis"
        return f"{scheme}://{HOST}:{self.port}"

    @property
    def unix_url(self) -> str:
        """``unix:///path/to/redis.sock``."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.procs.procs[self.name].pid

    def argv(self) -> list[str]:
        """The command line."""
        argv = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--unixsocket",
            self.socket_path,
            "--unixsocketperm",
            "700",
            "--daemonize",
            "no",
        ]
        if self.cluster:
            # The bus port defaults to port + 10000, which is past 65535 for high free ports.
            bus = str(free_port())
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"{self.name}-nodes.conf"]
            argv += ["--cluster-port", bus]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def client(self) -> redis.Redis:
        """A synchronous client for checks from tests and benchmarks."""
        return redis.Redis(host=HOST, port=self.port, password=self.password, socket_timeout=2.0)

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start (or restart, on the same port) and wait until it answers PING."""
        if self.cluster:
            # A restarted node must not come back with the previous run's cluster layout.
            with contextlib.suppress(FileNotFoundError):
                (self.dir / f"{self.name}-nodes.conf").unlink()
        proc = self.procs.start(self.name, self.argv())
        try:
            wait_for_port(HOST, self.port, timeout_s, proc=proc)
            with self.client() as c:
                c.ping()
                if self.cluster:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
                    deadline = time.monotonic() + timeout_s
                    while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        if time.monotonic() > deadline:
                            raise TimeoutError("one-node cluster did not reach cluster_state:ok")
                        time.sleep(0.02)
        except (RuntimeError, TimeoutError, redis.RedisError) as exc:
            raise RuntimeError(f"{exc}\n{self.procs.log_tail(self.name)}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: Redis disappears at once, as in a crash."""
        self.procs.kill(self.name)

    def pause(self) -> None:
        """SIGSTOP: Redis still accepts connections but never answers (a hung server)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop it by PID (a paused server is resumed first so it can exit)."""
        if self.name in self.procs.procs:
            with contextlib.suppress(ProcessLookupError):
                self.resume()
        self.procs.stop(self.name)


class LocalSentinel:
    """One Sentinel watching ``master`` under the service name ``service``."""

    def __init__(
        self,
        procs: ProcessGroup,
        directory: Path,
        master: LocalRedis,
        service: str = "mymaster",
        name: str = "sentinel",
    ) -> None:
        self.procs = procs
        self.dir = directory
        self.master = master
        self.service = service
        self.name = name
        self.port = free_port()

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:PORT/SERVICE``."""
        return f"redis+sentinel://{HOST}:{self.port}/{self.service}"

    def start(self, timeout_s: float = 10.0) -> LocalSentinel:
        """Write its config (Sentinel rewrites it) and start it; wait until it knows the master."""
        conf = self.dir / f"{self.name}.conf"
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self.dir}",
            f"sentinel monitor {self.service} {HOST} {self.master.port} 1",
            f"sentinel down-after-milliseconds {self.service} 5000",
        ]
        if self.master.password:
            lines.append(f"sentinel auth-pass {self.service} {self.master.password}")
        conf.write_text("\n".join(lines) + "\n")
        proc = self.procs.start(self.name, [redis_binary(), str(conf), "--sentinel"])
        try:
            wait_for_port(HOST, self.port, timeout_s, proc=proc)
            with redis.Redis(host=HOST, port=self.port, socket_timeout=2.0) as c:
                deadline = time.monotonic() + timeout_s
                while not c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service):
                    if time.monotonic() > deadline:
                        raise TimeoutError("sentinel does not know its master")
                    time.sleep(0.02)
        except (RuntimeError, TimeoutError, redis.RedisError) as exc:
            raise RuntimeError(f"{exc}\n{self.procs.log_tail(self.name)}") from None
        return self

    def stop(self) -> None:
        """Stop it by PID."""
        self.procs.stop(self.name)
