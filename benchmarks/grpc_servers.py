"""Python gRPC servers compared for the ext_proc message pattern: the do-nothing processor
(:mod:`extproc_lab.bench.bare_processor`) behind the real Envoy, once per server, in rounds.

    .venv/bin/python benchmarks/grpc_servers.py --rounds 3 --seconds 6 > benchmarks/grpc_servers.md

Setup as ``extproc bench overhead``'s (two instant fake replicas, wrk with 16 connections, 8 KB chat
prompts, three ext_proc messages a request: request headers, request body, response headers). Each
round measures every server once, in turn, so that a change in the shared machine's load falls on
all of them; the table gives each server's median over the rounds of throughput and of the CPU
per request of the processor and of Envoy. The servers are those of
:mod:`extproc_lab.bench.bare_processor` (``grpclib`` left out where it is not installed).
``extproc`` and ``extproc-asyncio`` are our own processor (the default configuration) on uvloop's
and on asyncio's event loop, measured the same way (not in the default list); ``base`` and
``base-asyncio`` the same from another checkout (``--base DIR``: ``git archive REV extproc | tar -x
-C DIR``), for a before and after in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from extproc.api import Config
from extproc_lab.bench.overhead import Wrk, cpu_seconds, rounds_table
from extproc_lab.bench.peer_routers import HOST, wait_serving
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.processes import wait_for_port

OURS = {"extproc": "auto", "extproc-asyncio": "asyncio", "base": "auto", "base-asyncio": "asyncio"}
"""Our processor, on the event loop ``EXTPROC_EVENT_LOOP`` picks (auto: uvloop where installed);
``base`` is the checkout ``--base`` names (its ``extproc`` first on ``PYTHONPATH``)."""
NEEDS = {"grpclib": "grpclib", "grpclib-uvloop": "grpclib"}


def start(gw: LocalGateway, server: str, threads: int, base: str | None = None) -> None:
    """The bare processor with ``server`` in the processor's place behind the gateway's Envoy (or,
    ``extproc`` and ``extproc-asyncio``, our processor on each event loop)."""
    name = gw.processor_name()
    if name in gw.procs.procs:
        gw.procs.stop(name)
    if server in OURS:
        os.environ["EXTPROC_EVENT_LOOP"] = OURS[server]
        os.environ.pop("PYTHONPATH", None)
        if server.startswith("base"):
            if base is None:
                raise SystemExit(f"{server} needs --base")
            os.environ["PYTHONPATH"] = base
        gw.start_processor()
        wait_serving(gw.url)
        return
    target = gw.members[0].name if gw.mode == "cluster" else gw.members[0].address
    cfg = Config()
    header = cfg.headers.target_cluster if gw.mode == "cluster" else cfg.headers.destination_endpoint
    argv = [sys.executable, "-m", "extproc_lab.bench.bare_processor", "--listen", f"{HOST}:{gw.processor_port}",
            "--header", header, "--target", target, "--server", server, "--threads", str(threads)]  # fmt: skip
    proc = gw.procs.start(name, argv)
    wait_for_port(HOST, gw.processor_port, proc=proc)
    wait_serving(gw.url)


def main() -> None:
    """Measure each server in rounds and print a Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="aio,uvloop,aio-rw,uvloop-rw,sync,grpclib,grpclib-uvloop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--threads", type=int, default=64, help="the sync server's thread pool")
    p.add_argument("--base", help="a directory holding another checkout's extproc/, for the base servers")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s paced (default: as fast as it goes)")
    args = p.parse_args()
    servers = [s for s in args.servers.split(",") if s not in NEEDS or importlib.util.find_spec(NEEDS[s])]
    wrk_bin = shutil.which("wrk")
    if wrk_bin is None:
        raise SystemExit("needs wrk (Debian package wrk)")
    runs: dict[str, list[tuple[float, float, float]]] = {s: [] for s in servers}
    with (
        tempfile.TemporaryDirectory(prefix="extproc-grpc-servers-") as tmp,
        LocalGateway(replicas=2, profile="instant") as gw,
    ):
        wrk = Wrk(wrk_bin, Path(tmp))
        envoy = gw.procs.procs["envoy"].pid
        for _ in range(args.rounds):
            for server in servers:
                start(gw, server, args.threads, args.base)
                wrk.run(gw.url, args.prompt_kb, args.connections, 2)  # warm up
                proc = gw.procs.procs[gw.processor_name()].pid
                before = cpu_seconds(proc), cpu_seconds(envoy)
                top = wrk.run(gw.url, args.prompt_kb, args.connections, args.seconds, rate=args.rate)
                after = cpu_seconds(proc), cpu_seconds(envoy)
                n = top["requests"] or 1
                runs[server].append((top["rps"], (after[0] - before[0]) / n * 1e6, (after[1] - before[1]) / n * 1e6))
                print(f"{server}: {runs[server][-1]}", file=sys.stderr)
    paced = f", paced at {args.rate:g} requests/s" if args.rate else ""
    print(f"{args.prompt_kb} KB prompts, {args.connections} connections{paced}, {args.seconds:g} s a run, "
          f"{args.rounds} rounds; medians (and the range over the rounds)\n")  # fmt: skip
    print(rounds_table("server", runs))


if __name__ == "__main__":
    main()
