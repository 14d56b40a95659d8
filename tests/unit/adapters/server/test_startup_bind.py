"""Start-up binds every listener before any serves, the ext_proc port last: a port already in use
stops ``extproc serve`` at once, non-zero, naming the address, and its ext_proc port never took a
connection; two processors that differ only in --listen and --metrics-listen both serve."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc._proto.admin.v1 import admin_pb2 as admin_pb
from extproc._proto.admin.v1 import admin_pb2_grpc as admin_grpc
from extproc.adapters.server.listeners import BindError, GrpcListener, Listener, MetricsListener, bind_all
from extproc_lab.demo.processes import free_port, wait_for_port
from tests.helpers import HOST, serve_argv, serving


def run_to_exit(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) != 0


@contextmanager
def taken(listening: bool = True) -> Iterator[int]:
    """A port held by this test: listening, as another processor's would be; or only bound, so
    that a connect to it is refused unless someone else manages to listen there."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))  # no SO_REUSEADDR: nobody else may bind it, listening or not
        if listening:
            holder.listen()
        yield holder.getsockname()[1]


def start_watching(argv: list[str], port: int, limit_s: float = 20.0) -> tuple[subprocess.CompletedProcess[str], int]:
    """Start ``argv`` and connect to ``port`` every 2 ms until it exits (at most ``limit_s``, for a
    loaded machine; it takes 2-5 s): its output, and how many connects succeeded (each one a
    connection the port accepted). The port a failing start used to bind first stayed listening
    until the interpreter exited, a second or so: hundreds of connects."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    accepted = attempts = 0
    deadline = time.monotonic() + limit_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with socket.socket() as probe:
                probe.settimeout(0.2)
                if probe.connect_ex((HOST, port)) == 0:
                    accepted += 1
            attempts += 1
            time.sleep(0.002)  # leave the processor the CPU to start on
    finally:
        if proc.poll() is None:
            proc.kill()  # still running after limit_s: the assertion on its exit code says so
        out, err = proc.communicate(timeout=10)
    assert attempts > 100, attempts  # the loop really watched the start-up
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), accepted


ROLES = ("ext_proc", "metrics", "admin", "gRPC health")


@pytest.mark.parametrize("role", ROLES)
def test_a_port_in_use_stops_the_start_and_the_ext_proc_port_never_accepts(role: str) -> None:
    # The ext_proc port itself taken: held without listening, so that a connect there succeeds
    # only if the processor listened on it after all.
    with taken(listening=role != "ext_proc") as busy:
        port = busy if role == "ext_proc" else free_port()
        extra = {
            "ext_proc": (),
            "metrics": (),
            "admin": ("--admin-listen", f"{HOST}:{busy}"),
            "gRPC health": ("--health-listen", f"{HOST}:{busy}"),
        }[role]
        argv = serve_argv(port, busy if role == "metrics" else free_port(), *extra)
        done, accepted = start_watching(argv, port)
    assert done.returncode == 3, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"extproc: cannot listen on {HOST}:{busy} ({role}): "), done.stderr
    assert "Traceback" not in done.stderr
    assert accepted == 0  # Envoy never had a connection to a processor that was not going to serve
    assert refused(port)


def test_a_second_serve_with_the_same_metrics_port_exits_naming_the_address() -> None:
    metrics_port = free_port()
    first, second = free_port(), free_port()
    with serving(serve_argv(first, metrics_port), first):
        wait_for_port(HOST, metrics_port)
        done, accepted = start_watching(serve_argv(second, metrics_port), second)
        assert done.returncode not in (0, None)
        assert f"{HOST}:{metrics_port}" in done.stderr and "metrics" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        # Its gRPC port never took a connection, and is gone: Envoy never saw a processor that would fail.
        assert accepted == 0 and refused(second)


def test_a_second_serve_with_the_same_grpc_port_exits_naming_the_address() -> None:
    port = free_port()
    with serving(serve_argv(port, free_port()), port):
        done = run_to_exit(serve_argv(port, free_port()))
    assert done.returncode not in (0, None)
    assert f"{HOST}:{port}" in done.stderr and "ext_proc" in done.stderr, done.stderr


async def _replicas_over_the_python_client(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await admin_grpc.AdminStub(channel).ListReplicas(admin_pb.ListReplicasRequest(), timeout=5)
    return [r.name for r in reply.replicas]


def test_two_processors_on_one_host_differing_only_in_listen_and_metrics_both_serve() -> None:
    """The report: two gateways on one host, each ``extproc serve`` with its own --listen and
    --metrics-listen and nothing else; the second one used to exit on the admin API's port."""
    (a, a_metrics), (b, b_metrics) = (free_port(), free_port()), (free_port(), free_port())
    with serving(serve_argv(a, a_metrics), a) as first, serving(serve_argv(b, b_metrics), b) as second:
        for port, metrics_port in ((a, a_metrics), (b, b_metrics)):
            with grpc.insecure_channel(f"{HOST}:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            wait_for_port(HOST, metrics_port)
        # Each one's admin API, on its own ext_proc port: by `extproc admin` (whose default is
        # the default --listen) and by the Python client.
        shown = subprocess.run(
            [sys.executable, "-m", "extproc", "admin", "--server", f"{HOST}:{a}", "--json", "replicas"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert shown.returncode == 0 and '"name": "r0"' in shown.stdout, shown.stderr
        assert asyncio.run(_replicas_over_the_python_client(f"{HOST}:{b}")) == ["r0"]
        assert first.poll() is None and second.poll() is None


def test_serving_is_reported_only_with_every_listener_bound() -> None:
    port, metrics_port = free_port(), free_port()
    with serving(serve_argv(port, metrics_port), port):
        wait_for_port(HOST, metrics_port)  # bound before the gRPC health answer below
        with grpc.insecure_channel(f"{HOST}:{port}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


class Recording:
    """A listener that records what happened to it (and fails to bind when told to)."""

    def __init__(self, role: str, log: list[str], fail: bool = False) -> None:
        self.role, self.address, self.log, self.fail = role, f"{HOST}:1", log, fail

    async def bind(self) -> None:
        if self.fail:
            raise BindError(self.role, self.address, "address already in use")
        self.log.append(f"bind {self.role}")

    async def start(self) -> None:
        self.log.append(f"start {self.role}")

    async def close(self) -> None:
        self.log.append(f"close {self.role}")


def test_bind_all_closes_what_it_bound_when_a_later_listener_fails() -> None:
    log: list[str] = []
    listeners: list[Listener] = [Recording("metrics", log), Recording("admin", log, fail=True)]
    with pytest.raises(BindError, match=r"cannot listen on 127\.0\.0\.1:1 \(admin\)"):
        asyncio.run(bind_all(listeners))
    assert log == ["bind metrics", "close metrics"]


def test_metrics_listener_names_its_address_when_the_port_is_taken() -> None:
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind((HOST, 0))
            taken.listen()
            address = f"{HOST}:{taken.getsockname()[1]}"
            listener = MetricsListener(CollectorRegistry(), address, lambda: None)
            with pytest.raises(BindError, match=address):
                await listener.bind()
            await listener.close()

    asyncio.run(scenario())


def test_the_metrics_port_is_taken_at_bind_and_answers_only_once_started() -> None:
    async def scenario() -> None:
        listener = MetricsListener(CollectorRegistry(), f"{HOST}:0", lambda: None)
        await listener.bind()
        url = f"http://{listener.address}/healthz"
        try:
            rival = MetricsListener(CollectorRegistry(), listener.address, lambda: None)
            with pytest.raises(BindError, match="metrics"):  # listening already: a rival cannot bind
                await rival.bind()
            async with aiohttp.ClientSession() as http:
                with pytest.raises(asyncio.TimeoutError):  # bound, but nothing answers yet
                    async with http.get(url, timeout=aiohttp.ClientTimeout(total=0.3)):
                        pass
                await listener.start()
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    assert resp.status == 200 and await resp.text() == "ok\n"
        finally:
            await listener.close()
        assert refused(int(listener.address.rpartition(":")[2]))

    asyncio.run(scenario())


def test_a_bound_grpc_port_takes_connections_before_start_so_ext_proc_binds_last() -> None:
    async def scenario() -> None:
        listener = GrpcListener("admin", f"{HOST}:0", grpc.aio.server())
        await listener.bind()
        # grpc listens in add_*_port: the kernel completes a connect, although nothing answers.
        # That is why the ext_proc port binds after every other port (cli._serve).
        assert not refused(listener.port)
        await listener.close()  # never started: its port is released all the same
        assert refused(listener.port)

    asyncio.run(scenario())
