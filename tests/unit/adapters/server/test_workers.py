"""``extproc serve --workers N`` as a process tree: the parent holds the port against other
processors, stops every worker on SIGTERM and unlinks the shared segment, and exits non-zero when
a worker dies on its own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from extproc.adapters.server.workers import budget_sharing, check_workers
from extproc.config import config_from_mapping
from extproc_lab.demo.processes import free_port
from tests.helpers import HOST, serve_argv, serving


def children(pid: int) -> list[int]:
    """The worker processes of ``pid`` (its spawned children, not multiprocessing's tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                out.append(int(child))
    return out


def wait_workers(pid: int, count: int, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = children(pid)
        if len(found) == count:
            return found
        time.sleep(0.1)  # real time: worker processes starting
    raise TimeoutError(f"{count} workers of {pid}: found {children(pid)}")


def workers(port: int, metrics_port: int, count: int = 2) -> AbstractContextManager[subprocess.Popen[bytes]]:
    return serving(serve_argv(port, metrics_port, "--workers", str(count)), port)


def segment_name(stderr: bytes) -> str:
    match = re.search(rb"sharing (\S+) \(", stderr)
    assert match, stderr
    return match.group(1).decode()


def test_sigterm_stops_every_worker_and_unlinks_the_segment() -> None:
    port, metrics_port = free_port(), free_port()
    with workers(port, metrics_port) as proc:
        pids = wait_workers(proc.pid, 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stderr is not None
        stderr = proc.stderr.read()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    assert not Path("/dev/shm", segment_name(stderr)).exists()


def test_a_worker_that_dies_stops_the_others_and_the_parent_exits_non_zero() -> None:
    port, metrics_port = free_port(), free_port()
    with workers(port, metrics_port) as proc:
        first, second = wait_workers(proc.pid, 2)
        os.kill(first, signal.SIGKILL)  # one of this test's own processes, by PID
        assert proc.wait(15) == 1
    assert not Path(f"/proc/{second}").exists() or b"zombie" in Path(f"/proc/{second}/status").read_bytes().lower()


def test_another_processor_cannot_join_the_workers_port() -> None:
    port, metrics_port = free_port(), free_port()
    with workers(port, metrics_port):
        for extra in ((), ("--workers", "2")):
            other = subprocess.run(serve_argv(port, free_port(), *extra), capture_output=True, timeout=60, check=False)
            assert other.returncode == 3, other.stderr
            assert f"{HOST}:{port}".encode() in other.stderr


def test_workers_do_not_start_on_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            serve_argv(port, free_port(), "--workers", "2"), capture_output=True, timeout=60, check=False
        )
    assert result.returncode == 3, result.stderr


@pytest.mark.parametrize(
    "extra", [("--listen", "unix:/tmp/extproc-workers.sock"), ("--kv-events-listen", "tcp://127.0.0.1:5557")]
)
def test_what_one_process_must_own_is_refused_with_workers(extra: tuple[str, ...]) -> None:
    argv = [*serve_argv(free_port(), free_port(), "--workers", "2"), *extra]
    result = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert b"workers:" in result.stderr


def test_workers_stop_when_their_parent_is_killed() -> None:
    port, metrics_port = free_port(), free_port()
    with workers(port, metrics_port) as proc:
        pids = wait_workers(proc.pid, 2)
        proc.kill()  # this test's own child, by its handle
        proc.wait(5)
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)  # real time: the OS reaping killed processes
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_budgets_with_the_memory_store_refuse_several_workers_and_a_shared_store_is_said(tmp_path: Path) -> None:
    # Each worker would count apart: N times every budget (issue 39). Refused at start, naming why.
    config = tmp_path / "router.yaml"
    config.write_text("budgets: {enabled: true, tenants: {acme: {per_day: 1000}}}\n")
    argv = [*serve_argv(free_port(), free_port(), "--workers", "2"), "--config", str(config)]
    result = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert b"workers: token budgets with the memory store" in result.stderr
    budgets = {"enabled": True, "tenants": {"acme": {"per_day": 1000}}}
    shared = config_from_mapping({"workers": 2, "store": "redis://:secret@127.0.0.1:6379/0", "budgets": budgets})
    assert check_workers(shared) is None
    said = budget_sharing(shared)
    assert said is not None and "shared store" in said and "secret" not in said
    metering = config_from_mapping({"workers": 2, "budgets": {"enabled": True}})
    assert check_workers(metering) is None and "metering only" in (budget_sharing(metering) or "")
    assert budget_sharing(config_from_mapping({"workers": 2})) is None
