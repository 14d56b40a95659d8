"""A clone alone: the repository carries the data its tests and benchmark tables read.

The clone is made into an empty temporary directory, so nothing is beside it (CI keeps reference
material next to its own checkout; a user's clone has none of it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc_lab.sim.traces import TRACES_ENV
from tests.conftest import ROOT, require_binary

# Every test that reads a file the repository ships (traces, workload parameters, the vLLM metrics
# page), plus the unit tests of what the benchmark is built on.
QUICK_SUBSET = (
    "lab/tests/test_workloads.py",
    "tests/unit/fleet/health/test_health.py",
    "tests/unit/request/test_request.py",
    "tests/unit/config/test_config.py",
    "tests/unit/routing/test_decision.py",
    "lab/tests/test_sim.py::test_generated_workloads_run_through_the_simulator",
)
BENCH = (sys.executable, "-m", "extproc", "bench", "routing", "--workload", "mooncake-synthetic", "--limit", "200")
OUTSIDE = ".." + "/shared"  # spelled apart so this file does not match its own check


def _env(*path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TRACES_ENV, "PYTHONPATH")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if path:
        env["PYTHONPATH"] = os.pathsep.join(map(str, path))
    return env


def _where(module: str, cwd: Path, env: dict[str, str]) -> Path:
    """The file ``module`` is imported from, as a program started in ``cwd`` would import it."""
    out = subprocess.run(
        [sys.executable, "-c", f"import {module}; print({module}.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=source,
        env=_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def _install(wheels: list[Path], target: Path) -> Path:
    """The wheels' files alone in ``target``; their dependencies come from this environment."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *map(str, wheels)],
        env=_env(),
        check=True,
        timeout=300,
        capture_output=True,
    )
    return target


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
    env = _env(clone / "lab")
    for module, home in (("extproc", clone), ("extproc_lab", clone / "lab")):
        assert _where(module, clone, env).is_relative_to(home), f"the clone's tests would not import its {module}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *QUICK_SUBSET],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout


@pytest.fixture(scope="module")
def wheels(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The router's wheel and the lab's, built from the clone."""
    out = tmp_path_factory.mktemp("wheels")
    return _wheel(clone, out / "router"), _wheel(clone / "lab", out / "lab")


def test_the_router_wheel_holds_no_lab_and_routes_alone(wheels: tuple[Path, Path], tmp_path: Path) -> None:
    router_wheel, _ = wheels
    names = zipfile.ZipFile(router_wheel).namelist()
    assert any(n.startswith("extproc/app/router.py") for n in names)
    assert [n for n in names if not n.startswith(("extproc/", "extproc_router-"))] == []
    assert [
        n for n in names if n.startswith(("extproc/demo/", "extproc/sim/", "extproc/replica/", "extproc/bench/"))
    ] == []
    site = _install([router_wheel], tmp_path / "site")
    # -S: no .pth file runs, so the editable installs of this checkout (the lab's among them) are
    # out of reach; the dependencies come from this environment's site-packages as a plain path.
    python = (sys.executable, "-S")
    env = _env(site, Path(sysconfig.get_paths()["purelib"]))
    work = tmp_path / "cwd"
    work.mkdir()
    # In process: the router routes a chat request, and nothing of the lab was (or can be) imported.
    script = """
import asyncio, importlib.util, json, sys
import extproc
from extproc.config import Config, Metrics
from extproc.routing import Replica
from extproc.app.router import Router
cfg = Config(replicas=(Replica("a", "127.0.0.1:8001"), Replica("b", "127.0.0.1:8002")), metrics=Metrics(enabled=False))
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]}).encode()
routed = asyncio.run(Router(cfg).route({":path": "/v1/chat/completions", "x-session-id": "s1"}, body))
assert importlib.util.find_spec("extproc_lab") is None, "the lab is importable"
assert not [m for m in sys.modules if m.startswith("extproc_lab")]
print(extproc.__file__, routed.decision.replica.name)
"""
    out = subprocess.run([*python, "-c", script], cwd=work, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    where, replica = out.stdout.split()
    assert Path(where).is_relative_to(site) and replica in ("a", "b")
    # The command line has the router's commands only.
    usage = subprocess.run(
        [*python, "-m", "extproc", "--help"], cwd=work, env=env, capture_output=True, text=True, check=True
    ).stdout
    commands = set(usage.split("{", 1)[1].split("}", 1)[0].split(","))
    assert "serve" in commands and not commands & {"replica", "demo", "bench"}, commands


def test_the_installed_wheels_run_a_trace_benchmark(wheels: tuple[Path, Path], tmp_path: Path) -> None:
    """The lab's wheel carries the traces ``bench routing`` reads, installed outside any checkout."""
    site = _install(list(wheels), tmp_path / "site")
    env = _env(site)
    work = tmp_path / "cwd"
    work.mkdir()
    assert _where("extproc_lab", work, env).is_relative_to(site)
    run = subprocess.run(
        [*BENCH, "--quiet", "--no-plots", "--json", str(work / "out.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "extproc" in run.stdout and "round_robin" in run.stdout
    assert (work / "out.json").stat().st_size > 0
