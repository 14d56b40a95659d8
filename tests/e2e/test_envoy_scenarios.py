"""Each scenario's verify script passes: real Envoy with the shipped config, the processor and
fake replicas on free loopback ports (see envoy/<scenario>/verify.py for what each proves)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, require_binary

pytestmark = pytest.mark.e2e
SCRIPTS = sorted((ROOT / "envoy").glob("*/verify.py"))


def test_every_scenario_has_a_verify_script() -> None:
    assert {p.parent.name for p in SCRIPTS} == {p.parent.name for p in (ROOT / "envoy").glob("*/envoy.yaml")}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_verify_script_passes(script: object) -> None:
    require_binary("envoy")
    # A scenario takes 2-10 s here; the bound only stops a hung run, and the script stops every
    # process it started (ProcessGroup) on any exit, a timeout's SIGKILL aside.
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
