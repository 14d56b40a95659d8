"""How long Envoy waits for each of the processor's answers, ours against the do-nothing Python
processor, read from Envoy's access log (``extproc envoy-config --access-log``).

Real Envoy in front of fake replicas on this machine; each arm is a fresh gateway: ``ours`` (our
processor, default configuration) and ``bare`` (:mod:`extproc_lab.bench.bare_processor`: every
message answered at once with a prebuilt answer, the floor of any grpc.aio processor; served as ours
is, on uvloop through ``context.read()`` and ``write()``, or on another server with
``--bare-server``, its streams taking the replicas in turn). Each arm sends ``--requests``
completions (a 600-word prompt, 8 openings) from ``--workers`` clients at once, after 10 untimed;
``--hogs N`` runs N busy loops beside it (CPU taken as engines would take it); ``--engine vllm``
puts real vLLM CPU engines (``--replicas`` of them, the ``small`` model, 128 blocks of 32 tokens, as
``bench realstack --engine vllm``) in place of the fake replicas, so the exchanges happen while the
engines prefill other requests, our processor configured for them (tokenizer, and their KV events
unless ``--no-kv-events``); ``--nice-engines N`` lowers every engine thread's priority. The means
are over the timed requests (:func:`extproc_lab.bench.envoy_log.time_before_upstream`).

    .venv/bin/python benchmarks/processor_exchanges.py                       # one client at a time
    .venv/bin/python benchmarks/processor_exchanges.py --workers 4 --stream  # four at once, streamed
    .venv/bin/python benchmarks/processor_exchanges.py --hogs 3              # beside three busy loops
    .venv/bin/python benchmarks/processor_exchanges.py --engine vllm --workers 4 --stream --requests 120
    .venv/bin/python benchmarks/processor_exchanges.py --engine vllm --workers 4 --stream --requests 120 --replicas 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from extproc_lab.bench.bare_processor import SERVERS
from extproc_lab.bench.envoy_log import time_before_upstream
from extproc_lab.bench.overhead import swap_in_bare_processor
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.fleet import EngineSettings

WARMUP = 10


@dataclass(frozen=True, slots=True)
class Setup:
    """One run's settings, every arm alike (the command line's flags)."""

    requests: int = 200
    workers: int = 1
    stream: bool = False
    engine: str = "fake"
    replicas: int = 3
    nice_engines: int = 0
    kv_events: bool = True
    processor_args: tuple[str, ...] = ()
    bare_server: str = "uvloop-rw"


def _send(url: str, text: str, stream: bool) -> None:
    body = json.dumps({"model": "demo-model", "prompt": text, "max_tokens": 16, "stream": stream}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def _renice_engines(niceness: int) -> None:
    """Every thread of every vLLM process (API servers and engine cores) at ``niceness``."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm" not in cmdline.lower() or b"processor_exchanges" in cmdline:
            continue
        for task in (proc / "task").iterdir():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)


def _gateway(setup: Setup, log: Path) -> LocalGateway:
    options: dict[str, Any] = {"access_log": str(log)}
    if setup.engine == "vllm":
        return LocalGateway(
            replicas=setup.replicas,
            engine="vllm",
            engine_settings=EngineSettings(model="small", block_size=32, num_blocks=128),
            envoy_options=options,
            processor_args=setup.processor_args,
            kv_events=setup.kv_events,
        )
    return LocalGateway(
        replicas=setup.replicas, time_scale=0.2, envoy_options=options, processor_args=setup.processor_args
    )


def run_arm(arm: str, setup: Setup) -> dict[str, Any]:
    """One arm on a fresh gateway: its timed requests' means."""
    with tempfile.TemporaryDirectory(prefix="extproc-exchanges-") as tmp:
        log = Path(tmp) / "access.jsonl"
        with _gateway(setup, log) as gw:
            if setup.nice_engines:
                _renice_engines(setup.nice_engines)
            # The replicas in turn; by default served as ours is (uvloop, context.read() and write()).
            url = swap_in_bare_processor(gw, server=setup.bare_server, spread=True) if arm == "bare" else gw.url
            for i in range(WARMUP):
                _send(url, f"warm {i} " + "word " * 600, setup.stream)

            def one(i: int) -> None:
                _send(url, f"{arm} {i % 8} " + "word " * 600 + str(i), setup.stream)

            with ThreadPoolExecutor(setup.workers) as pool:
                list(pool.map(one, range(setup.requests)))
        # Read once Envoy has stopped (it writes the file as it exits); the timed requests only.
        timed = log.read_text().splitlines()[-setup.requests :]
        kept = Path(tmp) / "timed.jsonl"
        kept.write_text("\n".join(timed) + "\n")
        return time_before_upstream(kept)


def main() -> None:
    """Parse the arguments, run each arm, print the means as JSON."""
    d = Setup()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="ours,bare", help="ours, bare, or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--workers", type=int, default=d.workers, help="clients sending at once")
    ap.add_argument("--stream", action="store_true", help="streamed completions")
    ap.add_argument("--hogs", type=int, default=0, help="busy loops beside the gateway")
    ap.add_argument("--engine", choices=("fake", "vllm"), default=d.engine)
    ap.add_argument(
        "--replicas",
        type=int,
        default=d.replicas,
        help="replicas (the do-nothing processor's streams take them in turn)",
    )
    ap.add_argument(
        "--nice-engines", type=int, default=d.nice_engines, help="real engines: every thread at this niceness"
    )
    ap.add_argument("--no-kv-events", action="store_true", help="real engines: our processor without their KV events")
    ap.add_argument("--processor-arg", action="append", default=[], help="a flag for our processor (repeatable)")
    ap.add_argument(
        "--bare-server", choices=SERVERS, default=d.bare_server, help="the do-nothing processor's gRPC server"
    )
    args = ap.parse_args()
    setup = Setup(
        requests=args.requests,
        workers=args.workers,
        stream=args.stream,
        engine=args.engine,
        replicas=args.replicas,
        nice_engines=args.nice_engines,
        kv_events=not args.no_kv_events,
        processor_args=tuple(args.processor_arg),
        bare_server=args.bare_server,
    )
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        out = {arm: run_arm(arm, setup) for arm in args.arms.split(",")}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(json.dumps({"setup": {**asdict(setup), "arms": args.arms, "hogs": args.hogs}, "arms": out}, indent=1))


if __name__ == "__main__":
    main()
