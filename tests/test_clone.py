"""A clone alone: the repository carries the data its tests and benchmark tables read.

The clone is made into an empty temporary directory, so nothing is beside it (CI keeps reference
material next to its own checkout; a user's clone has none of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.sim.traces import TRACES_ENV
from tests.conftest import ROOT, require_binary

# Every test that reads a file the repository ships (traces, workload parameters, the vLLM metrics
# page), plus the unit tests of what the benchmark is built on.
QUICK_SUBSET = (
    "tests/test_workloads.py",
    "tests/test_health.py",
    "tests/test_request.py",
    "tests/test_config.py",
    "tests/test_decision.py",
    "tests/test_sim.py::test_generated_workloads_run_through_the_simulator",
)
OUTSIDE = ".." + "/shared"  # spelled apart so this file does not match its own check


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TRACES_ENV, "PYTHONPATH")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The committed repository cloned into an empty directory."""
    git = require_binary("git")
    parent = tmp_path_factory.mktemp("empty")
    target = parent / "repo"
    subprocess.run([git, "clone", "-q", str(ROOT), str(target)], check=True, timeout=120)
    assert sorted(p.name for p in parent.iterdir()) == ["repo"]
    yield target


def test_nothing_in_the_repository_points_outside_it() -> None:
    git = require_binary("git")
    files = subprocess.run([git, "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".gz", ".png") or not path.is_file():
            continue
        if OUTSIDE in path.read_text(encoding="utf-8", errors="replace"):
            offenders.append(name)
    assert offenders == []


def test_the_quick_subset_passes_in_a_fresh_clone(clone: Path) -> None:
    where = subprocess.run(
        [sys.executable, "-c", "import extproc; print(extproc.__file__)"],
        cwd=clone,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(clone), f"the clone's tests would import {where}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *QUICK_SUBSET],
        cwd=clone,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout


def test_the_installed_wheel_runs_a_trace_benchmark(clone: Path, tmp_path: Path) -> None:
    """The wheel alone (installed outside any checkout) carries the traces ``bench routing`` reads."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
        cwd=clone,
        env=_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = wheels.glob("extproc_router-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        env=_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    # The dependencies come from this environment; extproc itself only from the wheel's files.
    env = {**_env(), "PYTHONPATH": str(site)}
    work = tmp_path / "cwd"
    work.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import extproc; print(extproc.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(site)
    run = subprocess.run(
        [sys.executable, "-m", "extproc", "bench", "routing", "--workload", "mooncake-synthetic", "--limit", "200"]
        + ["--quiet", "--no-plots", "--json", str(work / "out.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "extproc" in run.stdout and "round_robin" in run.stdout
    assert (work / "out.json").stat().st_size > 0
