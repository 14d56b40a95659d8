"""Start-up binds every listener before serving: a port already in use stops ``extproc serve`` at
once, non-zero, naming the address, and nothing is ever reported SERVING."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.server.listeners import BindError, Listener, MetricsListener, bind_all
from extproc_lab.demo.processes import free_port, wait_for_port

HOST = "127.0.0.1"


def serve_argv(port: int, metrics_port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "extproc",
        "serve",
        "--listen",
        f"{HOST}:{port}",
        "--metrics-listen",
        f"{HOST}:{metrics_port}",
        "--replica",
        "r0=127.0.0.1:9",
        "--admin-listen",  # not the default 9191: suites run side by side on one host
        f"{HOST}:{free_port()}",
        *extra,
    ]


@contextmanager
def serving(argv: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(HOST, port, proc=proc)
        yield proc
    finally:
        proc.terminate()  # this test's own child, by its handle
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_to_exit(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) != 0


def test_a_second_serve_with_the_same_metrics_port_exits_naming_the_address() -> None:
    metrics_port = free_port()
    first, second = free_port(), free_port()
    with serving(serve_argv(first, metrics_port), first):
        wait_for_port(HOST, metrics_port)
        done = run_to_exit(serve_argv(second, metrics_port))
        assert done.returncode not in (0, None)
        assert f"{HOST}:{metrics_port}" in done.stderr and "metrics" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        # It is gone, and its gRPC port with it: Envoy never saw a processor that would fail.
        assert refused(second)


def test_a_second_serve_with_the_same_grpc_port_exits_naming_the_address() -> None:
    port = free_port()
    with serving(serve_argv(port, free_port()), port):
        done = run_to_exit(serve_argv(port, free_port()))
    assert done.returncode not in (0, None)
    assert f"{HOST}:{port}" in done.stderr and "ext_proc" in done.stderr, done.stderr


def test_the_health_port_in_use_stops_the_start_too() -> None:
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    try:
        health = f"{HOST}:{taken.getsockname()[1]}"
        port = free_port()
        done = run_to_exit(serve_argv(port, free_port(), "--health-listen", health))
    finally:
        taken.close()
    assert done.returncode not in (0, None)
    assert health in done.stderr and "health" in done.stderr, done.stderr


def test_the_admin_port_in_use_stops_the_start_too() -> None:
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    try:
        admin = f"{HOST}:{taken.getsockname()[1]}"
        port = free_port()
        done = run_to_exit(serve_argv(port, free_port(), "--admin-listen", admin))
    finally:
        taken.close()
    assert done.returncode not in (0, None)
    assert admin in done.stderr and "admin" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert refused(port)


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
