"""``extproc bench overhead``: what a router costs, ours beside the peers, in one run.

The same two fake replicas (profile ``instant``: no model time) sit behind each router in turn:

- ``envoy_direct``: Envoy's own round robin, no processor (the floor every Envoy path pays);
- ``extproc``: Envoy with our ext_proc processor (every request a full routing decision);
- ``sglang_router``, ``vllm_router`` and ``smg``: the Rust peers, from PyPI, in venvs of their own;
- ``bare_extproc``: Envoy with a do-nothing Python ext_proc server (:mod:`extproc_lab.bench.bare_processor`)
  in our processor's place: the floor of any grpc.aio processor, for reference.

Load comes from ``wrk`` (Debian package ``wrk``, one thread) on the same machine, so every figure
is for everything sharing its cores. Three runs per router: the most it serves with
``--connections`` connections and ``--prompt-kb`` prompts; latency at a paced ``--rate`` (wrk
sends on a schedule, so the rate is the same for every router); throughput with ``--large-kb``
prompts. Every request carries its own ``x-session-id``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.api import Config
from extproc_lab.bench.peer_routers import HOST, PEER_ROUTERS, default_peers_dir, start_peer, wait_serving
from extproc_lab.demo import load
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.processes import wait_for_port

OURS = "extproc"
BARE = "bare_extproc"
ROUTERS = ("envoy_direct", OURS, *PEER_ROUTERS, BARE)
# The processes whose CPU a router costs (the replicas and wrk are the same for every router).
ROUTER_PROCESSES = {
    "envoy_direct": ("envoy",),
    OURS: ("envoy", "processor"),
    **{name: (name,) for name in PEER_ROUTERS},
    BARE: ("envoy", BARE),
}
CHAT_PATH = "/v1/chat/completions"

# One wrk thread drives every connection; requests are scheduled ``interval_ms`` apart when
# pacing (a LuaJIT clock, as wrk's Lua has none finer than a second), else sent back to back.
_LUA = """
local body = io.open("{body}"):read("*a")
local n = 0
local interval = {interval_ms}
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local ts = ffi.new("bench_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
local next_at = nil
request = function()
  n = n + 1
  return wrk.format("POST", "{path}",
    {{["content-type"] = "application/json", ["x-session-id"] = "bench-" .. n}}, body)
end
if interval > 0 then
  delay = function()
    local t = now_ms()
    if next_at == nil or next_at < t - 1000 then next_at = t end
    local d = next_at - t
    next_at = next_at + interval
    if d < 0 then return 0 end
    return math.floor(d)
  end
end
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def chat_body(size: int) -> bytes:
    """A chat request with a prompt of ``size`` bytes, asking for one token."""
    return load.chat_body(("gateway replica prefix cache session token " * (size // 40 + 1))[:size], max_tokens=1)


def parse_wrk(text: str) -> dict[str, float]:
    """Requests/s, latency percentiles (ms) and failures from ``wrk --latency`` output."""
    out: dict[str, float] = {}
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    out["rps"] = float(rps.group(1)) if rps else 0.0
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", text, re.MULTILINE)
        if m:
            out[f"p{pct}_ms"] = round(float(m.group(1)) * _UNITS[m.group(2)], 3)
    total = re.search(r"(\d+) requests in", text)
    out["requests"] = float(total.group(1)) if total else 0.0
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["errors"] = float(non_2xx.group(1)) if non_2xx else 0.0
    if sockets:
        out["errors"] += sum(float(g) for g in sockets.groups())
    return out


@dataclass(frozen=True, slots=True)
class OverheadSetup:
    """What to run: durations, load shape and which routers."""

    seconds: float = 10.0
    warmup_s: float = 2.0
    connections: int = 16
    prompt_kb: int = 8
    large_kb: int = 200
    rate: float = 1000.0
    routers: tuple[str, ...] = ROUTERS
    peers_dir: Path = field(default_factory=default_peers_dir)
    install: bool = True
    processor_args: tuple[str, ...] = ()
    observe_responses: bool = True
    sizes_kb: tuple[int, ...] = ()
    """Prompt sizes of the sweep (none: no sweep): req/s, CPU per request and paced latency at each."""
    sweep_rate: float = 100.0
    """Requests/s of the sweep's paced runs: low enough for every router at every size."""


class Wrk:
    """Runs ``wrk`` with the bench's Lua scripts (one thread: the other core serves)."""

    def __init__(self, binary: str, workdir: Path, threads: int = 1) -> None:
        self.binary = binary
        self.workdir = workdir
        self.threads = threads
        """wrk's threads (one: the other core serves; a scaling run on a larger machine gives more)."""
        self._scripts: dict[tuple[int, float], Path] = {}

    def script(self, size_kb: int, interval_ms: float) -> Path:
        """The Lua script for a body size and pacing (0: back to back), written once."""
        key = (size_kb, interval_ms)
        if key not in self._scripts:
            body = self.workdir / f"body-{size_kb}kb.json"
            if not body.exists():
                body.write_bytes(chat_body(size_kb * 1024))
            path = self.workdir / f"load-{size_kb}kb-{interval_ms:g}.lua"
            path.write_text(_LUA.format(body=body, interval_ms=interval_ms, path=CHAT_PATH))
            self._scripts[key] = path
        return self._scripts[key]

    def run(self, url: str, size_kb: int, connections: int, seconds: float, rate: float = 0.0) -> dict[str, float]:
        """One run; ``rate`` > 0 paces the requests at that many a second in all."""
        interval = 1000.0 / rate if rate > 0 else 0.0
        duration = max(1, round(seconds))
        argv = [self.binary, f"-t{self.threads}", f"-c{connections}", f"-d{duration}s", "--latency", "-s",
                str(self.script(size_kb, interval)), url]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()[:300]}")
        return parse_wrk(done.stdout)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process, its threads and its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            pending += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def rounds_table(first_column: str, runs: dict[str, list[tuple[float, float, float]]]) -> str:
    """A markdown table of rounds of (req/s, processor CPU us/request, Envoy CPU us/request) per
    row name: each cell the median over the rounds, with their range."""
    lines = [
        f"| {first_column} | req/s | processor CPU us/request | Envoy CPU us/request |",
        "|---|---|---|---|",
    ]
    for name, rows in runs.items():
        cells = []
        for i in range(3):
            column = [row[i] for row in rows]
            cells.append(f"{statistics.median(column):.0f} ({min(column):.0f}-{max(column):.0f})")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def replica_counts(metrics_urls: dict[str, str]) -> dict[str, float]:
    """Requests each replica has finished (``vllm:request_success_total``), by replica name."""
    out: dict[str, float] = {}
    for name, url in metrics_urls.items():
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        out[name] = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
        )
    return out


def swap_in_bare_processor(gw: LocalGateway, server: str = "aio", spread: bool = False) -> str:
    """Replace our processor behind the gateway's Envoy with the do-nothing one (``server``: one
    of :data:`extproc_lab.bench.bare_processor.SERVERS`; ``spread``: its streams take the
    replicas in turn, else all go to the first); Envoy's URL."""
    gw.procs.stop(gw.processor_name())
    cfg = Config()  # the gateway's processor runs with the default headers
    cluster_mode = gw.mode == "cluster"
    members = gw.members if spread else gw.members[:1]
    target = ",".join(m.name if cluster_mode else m.address for m in members)
    header = cfg.headers.target_cluster if cluster_mode else cfg.headers.destination_endpoint
    argv = [sys.executable, "-m", "extproc_lab.bench.bare_processor", "--listen", f"{HOST}:{gw.processor_port}",
            "--header", header, "--target", target, "--server", server]  # fmt: skip
    proc = gw.procs.start(BARE, argv)
    wait_for_port(HOST, gw.processor_port, proc=proc)
    wait_serving(gw.url)
    return gw.url


def measure(
    wrk: Wrk,
    url: str,
    setup: OverheadSetup,
    counts: Callable[[], dict[str, float]],
    pids: dict[str, int],
    router_processes: Sequence[str],
) -> dict[str, Any]:
    """The four runs against one router (throughput, one connection, paced, large prompts), how
    its requests spread over the replicas and the CPU each process used during the throughput run
    (``pids``: process name to pid)."""
    wrk.run(url, setup.prompt_kb, setup.connections, setup.warmup_s)
    before, cpu_before, started = counts(), {n: cpu_seconds(p) for n, p in pids.items()}, time.monotonic()
    top = wrk.run(url, setup.prompt_kb, setup.connections, setup.seconds)
    wall = time.monotonic() - started
    after, cpu_after = counts(), {n: cpu_seconds(p) for n, p in pids.items()}
    spread = {name: after[name] - before[name] for name in after}
    cpu = {n: cpu_after[n] - cpu_before[n] for n in pids}
    router_cpu = sum(cpu.get(n, 0.0) for n in router_processes)
    single = wrk.run(url, setup.prompt_kb, 1, max(1.0, setup.seconds / 2))
    paced = wrk.run(url, setup.prompt_kb, setup.connections, setup.seconds, rate=setup.rate)
    large = wrk.run(url, setup.large_kb, setup.connections, max(1.0, setup.seconds / 2))
    sizes = {str(kb): measure_size(wrk, url, setup, kb, pids, router_processes) for kb in setup.sizes_kb}
    return {
        "rps": top["rps"],
        "p50_ms": top.get("p50_ms"),
        "p99_ms": top.get("p99_ms"),
        "errors": top["errors"],
        "spread": spread,
        # Cores each process kept busy, and the router's own CPU per request (replicas and wrk excluded).
        "cpu_cores": {n: round(c / wall, 3) for n, c in cpu.items()},
        "router_cpu_us_per_request": round(router_cpu / top["requests"] * 1e6, 1) if top["requests"] else None,
        "one_connection": single,
        "paced": {"rate": setup.rate, **paced},
        "large": {"prompt_kb": setup.large_kb, **large},
        **({"sizes": sizes} if sizes else {}),
    }


def measure_size(
    wrk: Wrk, url: str, setup: OverheadSetup, size_kb: int, pids: dict[str, int], router_processes: Sequence[str]
) -> dict[str, float | None]:
    """One size of the sweep: throughput with the router's CPU per request, then paced latency."""
    half = max(1.0, setup.seconds / 2)
    wrk.run(url, size_kb, setup.connections, 1)
    cpu_before = sum(cpu_seconds(pids[n]) for n in router_processes if n in pids)
    top = wrk.run(url, size_kb, setup.connections, half)
    cpu = sum(cpu_seconds(pids[n]) for n in router_processes if n in pids) - cpu_before
    paced = wrk.run(url, size_kb, setup.connections, half, rate=setup.sweep_rate)
    return {
        "rps": top["rps"],
        "cpu_us_per_request": round(cpu / top["requests"] * 1e6, 1) if top["requests"] else None,
        "paced_p50_ms": paced.get("p50_ms"),
        "paced_p99_ms": paced.get("p99_ms"),
        "errors": top["errors"] + paced["errors"],
    }


def run_overhead(setup: OverheadSetup, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the replicas, Envoy, our processor and the peers; measure each router in turn."""
    binary = shutil.which("wrk")
    if binary is None:
        raise FileNotFoundError("wrk not found (Debian package wrk)")
    unknown = [r for r in setup.routers if r not in ROUTERS]
    if unknown:
        raise ValueError(f"unknown routers {unknown}; known: {', '.join(ROUTERS)}")
    routers: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="extproc-overhead-") as tmp,
        LocalGateway(
            replicas=2,
            profile="instant",
            processor_args=setup.processor_args,
            observe_responses=setup.observe_responses,
        ) as gw,
    ):
        wrk = Wrk(binary, Path(tmp))
        metrics = {r.name: f"http://{r.address}/metrics" for r in gw.members}
        urls = {"envoy_direct": gw.round_robin_url, OURS: gw.url}
        # The bare processor takes our processor's place, so it is measured last.
        for name in sorted(setup.routers, key=lambda r: r == BARE):
            try:
                if name == BARE:
                    url = swap_in_bare_processor(gw)
                else:
                    url = urls.get(name) or start_peer(gw, PEER_ROUTERS[name], setup.peers_dir, setup.install)
                progress(f"{name}: measuring at {url}")
                pids = {n: proc.pid for n, proc in gw.procs.procs.items() if proc.poll() is None}
                routers[name] = measure(wrk, url, setup, lambda: replica_counts(metrics), pids, ROUTER_PROCESSES[name])
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                routers[name] = {"error": str(exc)}
            progress(f"{name}: {json.dumps(routers[name])}")
            if name in PEER_ROUTERS and name in gw.procs.procs:
                gw.procs.stop(name)
    return {
        "routers": routers,
        "ours": OURS,
        "setup": {
            "replicas": 2,
            "replica_profile": "instant",
            "connections": setup.connections,
            "prompt_kb": setup.prompt_kb,
            "large_kb": setup.large_kb,
            "rate": setup.rate,
            "seconds": setup.seconds,
            "observe_responses": setup.observe_responses,
            "peers": {n: f"{p.package}=={p.version} --policy {p.policy}" for n, p in PEER_ROUTERS.items()},
            "sizes_kb": list(setup.sizes_kb),
            "sweep_rate": setup.sweep_rate,
        },
    }


def format_sizes_table(result: dict[str, Any], order: Sequence[str] = ROUTERS) -> str:
    """Markdown: the prompt-size sweep, one row a router and size; added p50/p99 against
    ``envoy_direct`` at the same size and paced rate."""
    s = result["setup"]
    rate = f"{s['sweep_rate']:g}"
    lines = [
        f"| router | prompt KB | req/s ({s['connections']} conns) | router CPU us/request | p50 ms at {rate}/s "
        f"| p99 ms at {rate}/s | added p50 ms | added p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    routers = result["routers"]
    base = routers.get("envoy_direct", {}).get("sizes", {})
    for kb in s.get("sizes_kb", []):
        floor = base.get(str(kb), {})
        for name in order:
            r = routers.get(name, {}).get("sizes", {}).get(str(kb))
            if r is None:
                continue

            def added(key: str, r: dict[str, Any] = r, name: str = name, floor: dict[str, Any] = floor) -> str:
                if name == "envoy_direct" or r.get(key) is None or floor.get(key) is None:
                    return ""
                return _fmt(r[key] - floor[key])

            label = f"{name} *" if name == result.get("ours") else f"({name})" if name == BARE else name
            lines.append(
                f"| {label} | {kb} | {r['rps']:.0f} | {_fmt(r['cpu_us_per_request'], 0)} | {_fmt(r['paced_p50_ms'])} "
                f"| {_fmt(r['paced_p99_ms'])} | {added('paced_p50_ms')} | {added('paced_p99_ms')} | {r['errors']:.0f} |"
            )
    return "\n".join(lines)


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def format_table(result: dict[str, Any], order: Sequence[str] = ROUTERS) -> str:
    """Markdown: one row a router; added p99 at the paced rate is against ``envoy_direct``."""
    s = result["setup"]
    rate = f"{s['rate']:g}"
    lines = [
        f"| router | req/s ({s['prompt_kb']} KB, {s['connections']} conns) | p50 ms | p99 ms | p50 ms, 1 conn "
        f"| p50 ms at {rate}/s | p99 ms at {rate}/s | added p99 ms at {rate}/s "
        f"| req/s ({s['large_kb']} KB) | router CPU us/request | errors | requests per replica |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    routers = result["routers"]
    base = routers.get("envoy_direct", {}).get("paced", {}).get("p99_ms")
    for name in order:
        r = routers.get(name)
        if r is None:
            continue
        label = f"{name} *" if name == result.get("ours") else f"({name})" if name == BARE else name
        if "error" in r:
            first = r["error"].splitlines()[0][:120] if r["error"] else "failed"
            lines.append(f"| {label} | failed: {first} |" + "  |" * 10)
            continue
        paced = r["paced"]
        added = "" if base is None or name == "envoy_direct" else _fmt(paced.get("p99_ms", 0) - base)
        spread = " / ".join(f"{v:.0f}" for _, v in sorted(r["spread"].items()))
        errors = r["errors"] + paced.get("errors", 0) + r["large"].get("errors", 0)
        errors += r.get("one_connection", {}).get("errors", 0)
        lines.append(
            f"| {label} | {r['rps']:.0f} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} "
            f"| {_fmt(r.get('one_connection', {}).get('p50_ms'))} | {_fmt(paced.get('p50_ms'))} "
            f"| {_fmt(paced.get('p99_ms'))} | {added} | {r['large']['rps']:.0f} "
            f"| {_fmt(r.get('router_cpu_us_per_request'), 0)} | {errors:.0f} | {spread} |"
        )
    return "\n".join(lines)
