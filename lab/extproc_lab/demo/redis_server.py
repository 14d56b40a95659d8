"""Local ``redis-server`` processes for tests, the demo and benchmarks: a plain server (over TLS
too), a replica of another, a Cluster of one node or several shards, and a Sentinel watching a
master. Started in a :class:`ProcessGroup`, ended by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

import redis

from extproc_lab.demo.certificates import CertificateSet
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
    that every key a script touches is in one slot, which a plain server never checks
    (``slots=None`` leaves the slots to :class:`LocalCluster`). ``tls`` serves TLS only on
    :attr:`port` (Debian's redis-server is built with TLS); ``replica_of`` replicates another.
    """

    def __init__(
        self,
        procs: ProcessGroup,
        directory: Path,
        name: str = "redis",
        port: int | None = None,
        cluster: bool = False,
        password: str | None = None,
        tls: CertificateSet | None = None,
        replica_of: LocalRedis | None = None,
        slots: tuple[int, int] | None = (0, 16383),
    ) -> None:
        self.procs = procs
        self.dir = directory
        self.name = name
        self.port = port or free_port()
        self.cluster = cluster
        self.password = password
        self.socket_path = str(directory / f"{name}.sock")
        self.tls = tls
        self.replica_of = replica_of
        self.slots = slots
        # The bus port defaults to port + 10000, which is past 65535 for high free ports.
        self.bus_port = free_port() if cluster else 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (``redis+cluster://`` for a cluster), without the password."""
        if self.tls is not None:
            return f"rediss://{HOST}:{self.port}?ssl_ca_certs={self.tls.ca_file}"
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
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            # TLS only: the plain port off. Clients need no certificate of their own.
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert_file)]
            ports += ["--tls-key-file", str(self.tls.key_file), "--tls-ca-cert-file", str(self.tls.ca_file)]
            ports += ["--tls-auth-clients", "no"]
        argv = [
            redis_binary(),
            *ports,
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
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"{self.name}-nodes.conf"]
            argv += ["--cluster-port", str(self.bus_port)]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.replica_of is not None:
            argv += ["--replicaof", HOST, str(self.replica_of.port)]
            if self.replica_of.password:
                argv += ["--masterauth", self.replica_of.password]
        return argv

    def client(self) -> redis.Redis:
        """A synchronous client for checks from tests and benchmarks."""
        if self.tls is not None:
            return redis.Redis(
                host=HOST,
                port=self.port,
                password=self.password,
                socket_timeout=2.0,
                ssl=True,
                ssl_ca_certs=str(self.tls.ca_file),
            )
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
                if self.cluster and self.slots is not None:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", *self.slots)
                    deadline = time.monotonic() + timeout_s
                    # A shard of several is ok only once they all met (LocalCluster waits for that).
                    while self.slots == (0, 16383) and b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
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
        down_after_ms: int = 5000,
    ) -> None:
        self.procs = procs
        self.dir = directory
        self.master = master
        self.service = service
        self.name = name
        self.port = free_port()
        self.down_after_ms = down_after_ms

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
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            # One sentinel (quorum 1) may fail over at once, and try again soon if that failed.
            f"sentinel failover-timeout {self.service} {max(1000, 2 * self.down_after_ms)}",
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

    def master_address(self) -> tuple[str, int] | None:
        """Where the sentinel says the master is now (None when it cannot tell)."""
        with redis.Redis(host=HOST, port=self.port, socket_timeout=2.0) as c:
            found = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        if not found:
            return None
        host, port = found
        return (host.decode() if isinstance(host, bytes) else host, int(port))

    def stop(self) -> None:
        """Stop it by PID."""
        self.procs.stop(self.name)


class LocalCluster:
    """A Redis Cluster of ``shards`` masters on loopback, the 16384 slots split evenly."""

    def __init__(self, procs: ProcessGroup, directory: Path, shards: int = 3, name: str = "shard") -> None:
        bounds = [round(i * 16384 / shards) for i in range(shards + 1)]
        self.nodes = [
            LocalRedis(procs, directory, name=f"{name}-{i}", cluster=True, slots=(bounds[i], bounds[i + 1] - 1))
            for i in range(shards)
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``."""
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 20.0) -> LocalCluster:
        """Start every node with its slots, introduce them, and wait for ``cluster_state:ok`` on all."""
        for node in self.nodes:
            node.start(timeout_s)
        with self.nodes[0].client() as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            with node.client() as c:
                while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{node.name}: the cluster did not reach cluster_state:ok")
                    time.sleep(0.05)
        return self

    def keys_per_node(self, match: str) -> list[int]:
        """How many keys matching ``match`` each node holds."""
        counts = []
        for node in self.nodes:
            with node.client() as c:
                counts.append(sum(1 for _ in c.scan_iter(match=match, count=1000)))
        return counts
