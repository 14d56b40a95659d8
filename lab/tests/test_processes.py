"""The lab's process group: every process it starts stays stoppable by its PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc_lab.demo.processes import PORTS_ENV, ProcessGroup, free_port, share_ports

# A real process that outlives the test unless the group stops it.
SLEEP = [sys.executable, "-c", "import time; time.sleep(30)"]


def test_a_name_still_running_is_refused_not_replaced(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        first = group.start("engine", SLEEP)
        with pytest.raises(RuntimeError, match="already running"):
            group.start("engine", SLEEP)
        assert group.procs["engine"] is first and first.poll() is None
        group.stop("engine")
        assert first.poll() is not None
        # Once stopped (or exited), the name may be started again.
        again = group.start("engine", SLEEP)
        assert again.pid != first.pid
    finally:
        group.stop_all()
    assert all(p.poll() is not None for p in (first, again))


def test_processes_given_their_share_of_ports_hand_out_disjoint_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    shares = [share_ports(i, 2) for i in range(2)]
    ranges = [tuple(int(p) for p in share.split("-")) for share in shares]
    assert ranges[0][1] <= ranges[1][0] and ranges[0][0] < ranges[0][1] and ranges[1][0] < ranges[1][1]
    for (start, stop), share in zip(ranges, shares, strict=True):
        monkeypatch.setenv(PORTS_ENV, share)
        assert all(start <= free_port() < stop for _ in range(20))


def test_a_process_ends_when_the_run_that_started_it_is_killed(tmp_path: Path) -> None:
    starter = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from extproc_lab.demo.processes import ProcessGroup\n"
        f"proc = ProcessGroup(Path({str(tmp_path)!r})).start('engine', {SLEEP!r})\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(30)\n"  # the run, alive until the test kills it
    )
    run = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    child = int(run.stdout.readline())
    os.kill(run.pid, signal.SIGKILL)  # as a CI timeout would: no teardown runs
    run.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)  # the kernel signals it at once; its exit takes a moment
    assert not _alive(child)


def test_a_process_starts_without_fork_handlers(tmp_path: Path) -> None:
    """A start forks nothing that runs at-fork handlers: gRPC's, in a run with live gRPC threads,
    restarted its poller in the child, which then aborted as it closed its descriptors."""
    starter = (
        "import os\n"
        "from pathlib import Path\n"
        "from extproc_lab.demo.processes import ProcessGroup\n"
        "ran = []\n"
        "os.register_at_fork(before=lambda: ran.append(1))\n"
        f"group = ProcessGroup(Path({str(tmp_path)!r}))\n"
        f"group.start('engine', {SLEEP!r})\n"
        "group.stop_all()\n"
        "print(len(ran))\n"
    )
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "0"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has ended (init reaps it)
    except FileNotFoundError:
        return False


def test_a_process_that_dies_before_answering_fails_at_once_with_its_log(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    dies = [sys.executable, "-c", "import sys; print('bind failed: address in use'); sys.exit(3)"]
    try:
        group.start("replica", dies)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"exited with 3[\s\S]*bind failed: address in use"):
            group.wait_healthy("replica", f"http://127.0.0.1:{free_port()}/health", timeout_s=10)
        assert time.monotonic() - started < 5
        # One that never answers times out, its log attached.
        group.start("mute", [sys.executable, "-c", "print('still importing', flush=True); import time; time.sleep(30)"])
        with pytest.raises(TimeoutError, match="still importing"):
            group.wait_healthy("mute", f"http://127.0.0.1:{free_port()}/health", timeout_s=1)
    finally:
        group.stop_all()
