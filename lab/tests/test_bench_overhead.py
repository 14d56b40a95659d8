"""``extproc bench overhead``: wrk output parsing, the table, and a short real run of every router."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc_lab.bench.overhead import (
    BARE,
    OURS,
    ROUTERS,
    OverheadSetup,
    format_sizes_table,
    format_table,
    parse_wrk,
    run_overhead,
)
from extproc_lab.bench.peer_routers import PEER_ROUTERS, default_peers_dir, install_all
from tests.conftest import IN_CI, require_binary

WRK_OUTPUT = """Running 5s test @ http://127.0.0.1:1
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.04ms    1.13ms  20.18ms   87.15%
  Latency Distribution
     50%    1.87ms
     75%    2.41ms
     90%    3.16ms
     99%  612.00us
  38432 requests in 5.00s, 21.23MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:   7686.97
Transfer/sec:      4.25MB
"""


def test_parse_wrk_reads_rate_percentiles_and_every_kind_of_failure() -> None:
    figures = parse_wrk(WRK_OUTPUT)
    assert figures["rps"] == pytest.approx(7686.97)
    assert figures["p50_ms"] == pytest.approx(1.87)
    assert figures["p99_ms"] == pytest.approx(0.612)  # microseconds converted
    assert figures["requests"] == 38432
    assert figures["errors"] == 4 + 2 + 1


def test_table_marks_ours_and_reports_failures_and_added_latency() -> None:
    row = {
        "rps": 1000.0,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "errors": 0.0,
        "spread": {"replica-0": 10.0, "replica-1": 5.0},
        "paced": {"rate": 1000.0, "rps": 999.0, "p50_ms": 0.5, "p99_ms": 1.5, "errors": 0.0},
        "large": {"prompt_kb": 200, "rps": 100.0, "errors": 1.0},
    }
    ours = {**row, "paced": {**row["paced"], "p99_ms": 4.0}}  # type: ignore[dict-item]
    result = {
        "routers": {"envoy_direct": row, OURS: ours, "sglang_router": {"error": "installing failed\ntail"}},
        "ours": OURS,
        "setup": {"rate": 1000.0, "prompt_kb": 8, "connections": 16, "large_kb": 200},
    }
    table = format_table(result)
    assert f"| {OURS} * | 1000 |" in table
    assert "| 2.50 |" in table  # 4.0 - 1.5 ms added at p99
    assert "| sglang_router | failed: installing failed |" in table
    assert "| 100 | - | 1 |" in table  # 200 KB req/s, no CPU figure, one error
    assert "10 / 5" in table


def test_peer_router_command_lines_stay_on_loopback(tmp_path: Path) -> None:
    for peer in PEER_ROUTERS.values():
        argv = peer.argv(tmp_path, 1234, 1235, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
        assert argv[argv.index("--policy") + 1] == peer.policy
        assert peer.env()["HF_ENDPOINT"].startswith("http://127.0.0.1:")


def test_unknown_router_is_a_clear_error() -> None:
    require_binary("wrk")
    with pytest.raises(ValueError, match="unknown routers"):
        run_overhead(OverheadSetup(routers=("nginx",)))


def test_every_benchmarks_default_peer_is_in_the_one_install_list() -> None:
    """``make peers`` installs ``PEER_ROUTERS``; a benchmark whose default names a peer outside it
    would pass only on a machine where that peer was installed by hand."""
    from extproc_lab.bench import realstack

    known_not_peers = {"envoy_direct", BARE, OURS, realstack.OURS, realstack.OURS_ESTIMATE, realstack.ROUND_ROBIN}
    for defaults in (ROUTERS, realstack.ROUTERS, realstack.VLLM_ROUTERS):
        assert set(defaults) - known_not_peers <= set(PEER_ROUTERS), defaults


def test_short_side_by_side_run_of_every_router(tmp_path: Path) -> None:
    """Every router serves the same replicas without errors and the JSON has the agreed shape.

    ``make test`` installs the peer routers first (``make peers``: into ``$EXTPROC_PEERS_DIR`` or
    ~/.cache); one missing fails under CI and is installed here elsewhere."""
    require_binary("wrk")
    require_binary("envoy")
    peers_dir = default_peers_dir()
    missing = [p.package for p in PEER_ROUTERS.values() if not p.installed(peers_dir)]
    if missing and IN_CI:
        pytest.fail(f"peer routers not installed in {peers_dir} (make peers): {missing}")
    try:
        install_all(peers_dir)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot install the peer routers: {exc}")
    out = tmp_path / "overhead.json"
    argv = [sys.executable, "-m", "extproc", "bench", "overhead", "--seconds", "1", "--warmup", "1",
            "--large-kb", "32", "--rate", "200", "--no-install", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ours"] == OURS
    assert set(result["routers"]) == set(ROUTERS)
    for name, figures in result["routers"].items():
        assert "error" not in figures, (name, figures)
        assert figures["rps"] > 0 and figures["p50_ms"] > 0 and figures["p99_ms"] >= figures["p50_ms"], name
        assert figures["errors"] == 0, name
        assert figures["paced"]["rps"] == pytest.approx(200, rel=0.25), name  # the schedule held
        assert sum(figures["spread"].values()) > 0, name
        assert figures["router_cpu_us_per_request"] > 0, name
    # The bare floor sends everything to one fixed replica: what arrives is what it routed.
    assert sorted(result["routers"][BARE]["spread"].values())[0] == 0
    assert f"| {OURS} * |" in done.stdout


def test_the_size_sweep_table_adds_latency_against_envoy_alone_at_each_size() -> None:
    def size(rps: float, p50: float, p99: float, cpu: float | None = 50.0) -> dict[str, object]:
        return {"rps": rps, "cpu_us_per_request": cpu, "paced_p50_ms": p50, "paced_p99_ms": p99, "errors": 0.0}

    result = {
        "routers": {
            "envoy_direct": {"sizes": {"1": size(9000, 0.4, 1.0), "1024": size(300, 3.0, 9.0)}},
            OURS: {"sizes": {"1": size(1500, 1.4, 3.5, 900.0), "1024": size(100, 8.0, 20.0, 5000.0)}},
        },
        "ours": OURS,
        "setup": {"sizes_kb": [1, 1024], "sweep_rate": 100.0, "connections": 16},
    }
    table = format_sizes_table(result)
    assert f"| {OURS} * | 1 | 1500 | 900 | 1.40 | 3.50 | 1.00 | 2.50 | 0 |" in table
    assert f"| {OURS} * | 1024 | 100 | 5000 | 8.00 | 20.00 | 5.00 | 11.00 | 0 |" in table
    assert "| envoy_direct | 1024 | 300 | 50 | 3.00 | 9.00 |  |  | 0 |" in table
