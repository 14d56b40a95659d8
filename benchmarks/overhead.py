"""What the processor adds: real Envoy with and without our ext_proc server in front of the same
fake replicas (profile ``instant``: no model time), 1 and 16 connections, 8 KB and 200 KB prompts.

Load comes from ``wrk`` (Debian package ``wrk``) on the same 2 cores as Envoy, the processor and
the replicas, so the figures are for everything sharing this machine. Each request carries its
own session id, so every request is a new routing decision (a lookup, a ring walk, a pin).

    .venv/bin/python benchmarks/overhead.py [--seconds 10] [--json benchmarks/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from extproc.demo.gateway import LocalGateway

LUA = """
local body = io.open("{body}"):read("*a")
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions",
    {{["content-type"] = "application/json", ["x-session-id"] = "bench-" .. n}}, body)
end
"""

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def body_of(size: int) -> bytes:
    """A chat request of about ``size`` bytes."""
    words = ("gateway replica prefix cache session token " * (size // 40 + 1))[:size]
    return json.dumps(
        {"model": "demo-model", "max_tokens": 1, "messages": [{"role": "user", "content": words}]}
    ).encode()


def parse_wrk(text: str) -> dict[str, float]:
    """Requests/s and latency percentiles (ms) from ``wrk --latency`` output."""
    out: dict[str, float] = {}
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    out["rps"] = float(rps.group(1)) if rps else 0.0
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", text, re.MULTILINE)
        if m:
            out[f"p{pct}_ms"] = float(m.group(1)) * UNITS[m.group(2)]
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non_2xx"] = float(errors.group(1)) if errors else 0.0
    return out


def run_wrk(wrk: str, url: str, script: Path, connections: int, seconds: int) -> dict[str, float]:
    """One wrk run (one thread: the other core is for Envoy, the processor and the replicas)."""
    argv = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30, check=True)
    return parse_wrk(result.stdout)


def main() -> int:
    """Run the matrix and print (and optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--no-observe", action="store_true", help="skip the response-headers phase")
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalGateway(replicas=2, profile="instant", observe_responses=not args.no_observe) as gw,
    ):
        for size_kb in (8, 200):
            body = Path(tmp) / f"body-{size_kb}.json"
            body.write_bytes(body_of(size_kb * 1024))
            script = Path(tmp) / f"post-{size_kb}.lua"
            script.write_text(LUA.format(body=body))
            for connections in (1, 16):
                for name, url in (("envoy only", gw.round_robin_url), ("envoy + extproc", gw.url)):
                    run_wrk(wrk, url, script, connections, 2)  # warm up connections and caches
                    figures = run_wrk(wrk, url, script, connections, args.seconds)
                    row = {"prompt_kb": size_kb, "connections": connections, "path": name, **figures}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    time.sleep(0.5)
    print()
    print(format_table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


def format_table(rows: list[dict[str, object]]) -> str:
    """Markdown table with the processor's added median latency per case."""
    lines = [
        "| prompt | connections | path | req/s | p50 ms | p99 ms | added p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    base: dict[tuple[object, object], float] = {}
    for r in rows:
        key = (r["prompt_kb"], r["connections"])
        p50 = float(r.get("p50_ms", 0.0))  # type: ignore[arg-type]
        added = ""
        if r["path"] == "envoy only":
            base[key] = p50
        elif key in base:
            added = f"{p50 - base[key]:.2f}"
        lines.append(
            f"| {r['prompt_kb']} KB | {r['connections']} | {r['path']} | {float(r['rps']):.0f} | "  # type: ignore[arg-type]
            f"{p50:.2f} | {float(r.get('p99_ms', 0.0)):.2f} | {added} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
