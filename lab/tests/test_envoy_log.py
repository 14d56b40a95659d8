"""Reading Envoy's access log for where a run's requests spent their time before the replica."""

from __future__ import annotations

import json
from pathlib import Path

from extproc_lab.bench.envoy_log import format_envoy_table, time_before_upstream


def _line(**fields: object) -> str:
    return json.dumps({"method": "POST", "status": 200, **fields})


def test_means_split_the_time_before_the_replica_and_skip_what_is_not_a_request(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    rows = [
        _line(received_us=1000, upstream_sent_us=5000, ext_proc_request_header_latency_us="800",
              ext_proc_request_body_total_latency_us="2000", ext_proc_response_header_latency_us="300"),
        _line(received_us=3000, upstream_sent_us=9000, ext_proc_request_header_latency_us="1200",
              ext_proc_request_body_total_latency_us="4000"),
        json.dumps({"method": "GET", "status": 200, "received_us": 1, "upstream_sent_us": 2}),  # a probe
        _line(status=503, received_us=1, upstream_sent_us=2),  # not answered
        '{"method": "POST", "status": 200, "recei',  # cut short as Envoy was killed
    ]  # fmt: skip
    log.write_text("\n".join(rows) + "\n")
    out = time_before_upstream(log)
    assert out["requests"] == 2
    assert out["received_mean_ms"] == 2.0 and out["to_upstream_mean_ms"] == 7.0
    assert out["processor_headers_mean_ms"] == 1.0 and out["processor_body_mean_ms"] == 3.0
    assert out["processor_response_headers_mean_ms"] == 0.3  # only where it was read
    # 5000 - 1000 - 2000 and 9000 - 3000 - 4000
    assert out["envoy_own_mean_ms"] == 2.0


def test_no_log_is_no_figures(tmp_path: Path) -> None:
    out = time_before_upstream(tmp_path / "missing.jsonl")
    assert out["requests"] == 0 and out["to_upstream_mean_ms"] is None


def test_the_table_has_a_row_for_each_logged_router() -> None:
    logged = {"requests": 2, "received_mean_ms": 2.0, "to_upstream_mean_ms": 7.0, "envoy_own_mean_ms": 2.0}
    logged |= {f"processor_{k}_mean_ms": 1.0 for k in ("headers", "body")} | {
        "processor_response_headers_mean_ms": None
    }
    table = format_envoy_table({"extproc": {"envoy": logged}, "smg": {}, "idle": {"envoy": {"requests": 0}}})
    rows = [line for line in table.splitlines() if line.startswith("| extproc")]
    assert rows == ["| extproc | 2 | 2.00 | 1.00 / 1.00 / - | 2.00 | 7.00 |"]
    assert "smg" not in table and "idle" not in table
    assert format_envoy_table({"smg": {}}) == ""
