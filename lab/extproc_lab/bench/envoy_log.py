"""Where a run's requests spent their time in Envoy, read from its access log (``--access-log``).

Each line (``extproc.adapters.envoy_config.access_log``) says when the client's body had come,
when the request left for the replica, and how long Envoy waited for each of the processor's
answers. Their means split the time a router adds before the engine starts: the body's arrival,
the processor's answers as Envoy saw them (our code, gRPC and both event loops), and the rest,
Envoy's own.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

_MS = 1000.0


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The log's lines that parse as JSON objects (a line cut short by a killed Envoy is skipped)."""
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def _us(line: dict[str, Any], key: str) -> float | None:
    """A time field in microseconds (the filter's fields come as strings), None when absent."""
    value = line.get(key)
    try:
        return float(value) if value not in (None, "-", "") else None
    except (TypeError, ValueError):
        return None


def _mean_ms(values: list[float]) -> float | None:
    return round(statistics.fmean(values) / _MS, 3) if values else None


def time_before_upstream(path: Path) -> dict[str, Any]:
    """Means, in ms, over the answered requests (POST, status 200) of the log at ``path``:
    ``received`` (first byte to the whole body), ``to_upstream`` (first byte to the request leaving
    for the replica), the processor's answers as Envoy waited for them (``processor_headers``,
    ``processor_body``, ``processor_response_headers``), and ``envoy_own`` (``to_upstream`` less
    the body's arrival and the body's answer: what Envoy itself took between them, and the headers'
    answer where it outlasted the body)."""
    lines = [line for line in read_lines(path) if line.get("status") == 200 and line.get("method") == "POST"]
    columns: dict[str, list[float]] = {
        "received": [],
        "to_upstream": [],
        "processor_headers": [],
        "processor_body": [],
        "processor_response_headers": [],
        "envoy_own": [],
    }
    for line in lines:
        received, sent = _us(line, "received_us"), _us(line, "upstream_sent_us")
        headers = _us(line, "ext_proc_request_header_latency_us")
        body = _us(line, "ext_proc_request_body_total_latency_us")
        answer = _us(line, "ext_proc_response_header_latency_us")
        for key, value in (
            ("received", received),
            ("to_upstream", sent),
            ("processor_headers", headers),
            ("processor_body", body),
            ("processor_response_headers", answer),
        ):
            if value is not None:
                columns[key].append(value)
        if received is not None and sent is not None:
            columns["envoy_own"].append(sent - received - (body or 0.0))
    out: dict[str, Any] = {"requests": len(lines)}
    out.update({f"{key}_mean_ms": _mean_ms(values) for key, values in columns.items()})
    return out


def format_envoy_table(routers: dict[str, dict[str, Any]]) -> str:
    """Markdown: each router behind Envoy, the means of :func:`time_before_upstream` (empty
    when no router's run was logged)."""
    rows = [(name, r["envoy"]) for name, r in routers.items() if r.get("envoy", {}).get("requests")]
    if not rows:
        return ""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| router (through Envoy) | requests | body received | processor: headers / body / response headers "
        "| Envoy's own | to the replica |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in rows:
        processor = " / ".join(ms(e[f"processor_{k}_mean_ms"]) for k in ("headers", "body", "response_headers"))
        lines.append(
            f"| {name} | {e['requests']} | {ms(e['received_mean_ms'])} | {processor} | {ms(e['envoy_own_mean_ms'])} "
            f"| {ms(e['to_upstream_mean_ms'])} |"
        )
    return "\n".join(lines) + "\n\nmeans in ms from the request's first byte at Envoy (its access log)"
