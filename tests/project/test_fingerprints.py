"""The simulator's committed fingerprints (benchmarks/sim_fingerprint.json) still hold: a change
to the router, the simulator or a peer policy that was meant to change no decision changes no
outcome of a simulated run.

The hashes are of ``repr`` of every float the runs produce. A float's repr is exact and the same
on every platform, but the floats pass through the C library's ``exp``/``log``/``pow``, which may
differ in the last bit between C libraries or CPUs: the file holds for x86_64 Debian with CI's
Python, where it was made (and where CI runs). Elsewhere a difference may be the platform's.

The full set takes about 20 s on an idle core and twice that on a busy one; this test compares a
subset that runs in about half of it: our profiles (with and without KV events), one peer at the
small cache (the simulator's own paths), the dynamic runs (joins, leaves, rebalancing, pre-warming)
and the priority queue. `make fingerprints-check` compares every run.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "sim_fingerprint.py"
STORED = ROOT / "benchmarks" / "sim_fingerprint.json"
SUBSET = ("sim/extproc/*", "sim/kv_events/*", "sim/gie_default/3000", "dyn/*", "prio/*")
HOW = (
    "If the change of behaviour is meant, regenerate with `make fingerprints` and say in the commit why "
    "the runs changed; a regeneration without a reason hides a regression."
)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


def test_every_run_has_a_stored_fingerprint() -> None:
    listed = _script("--list")
    assert listed.returncode == 0, listed.stderr
    runs = set(listed.stdout.split())
    stored = set(json.loads(STORED.read_text(encoding="utf-8")))
    missing = sorted(runs - stored)
    unknown = sorted(k for k in stored if k.removesuffix("/summary") not in runs)
    assert (missing, unknown) == ([], []), f"the stored file is not the script's runs. {HOW}"


def test_simulated_runs_match_the_stored_fingerprints() -> None:
    checked = _script("--check", str(STORED), "--only", *SUBSET)
    assert checked.returncode == 0, (
        f"{checked.stdout}{checked.stderr}(A regeneration without a reason hides a regression.)"
    )
