"""The lab's process group: every process it starts stays stoppable by its PID."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from extproc_lab.demo.processes import ProcessGroup

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
