"""How long Envoy waits for each of the processor's answers, ours against the do-nothing Python
processor, read from Envoy's access log (``extproc envoy-config --access-log``).

Real Envoy in front of fake replicas on this machine; each arm is a fresh gateway: ``ours`` (our
processor, default configuration) and ``bare`` (:mod:`extproc_lab.bench.bare_processor`: every
message answered at once with a prebuilt answer, the floor of any grpc.aio processor). Each arm
sends ``--requests`` completions (a 600-word prompt, 8 openings) from ``--workers`` clients at
once, after 10 untimed; ``--hogs N`` runs N busy loops beside it (CPU taken as engines would take
it); ``--engine vllm`` puts three real vLLM CPU engines (the ``small`` model, 128 blocks of 32
tokens, as ``bench realstack --engine vllm``) in place of the fake replicas, so the exchanges
happen while the engines prefill other requests. The means are over the timed requests
(:func:`extproc_lab.bench.envoy_log.time_before_upstream`).

    .venv/bin/python benchmarks/processor_exchanges.py                       # one client at a time
    .venv/bin/python benchmarks/processor_exchanges.py --workers 4 --stream  # four at once, streamed
    .venv/bin/python benchmarks/processor_exchanges.py --hogs 3 --arms ours  # beside three busy loops
    .venv/bin/python benchmarks/processor_exchanges.py --engine vllm --workers 4 --stream --requests 120
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from extproc_lab.bench.envoy_log import time_before_upstream
from extproc_lab.bench.overhead import swap_in_bare_processor
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.fleet import EngineSettings

WARMUP = 10


def _send(url: str, text: str, stream: bool) -> None:
    body = json.dumps({"model": "demo-model", "prompt": text, "max_tokens": 16, "stream": stream}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def _gateway(engine: str, log: Path, processor_args: tuple[str, ...], kv_events: bool = True) -> LocalGateway:
    options: dict[str, Any] = {"access_log": str(log)}
    if engine == "vllm":
        settings = EngineSettings(model="small", block_size=32, num_blocks=128)
        return LocalGateway(
            replicas=3,
            engine="vllm",
            engine_settings=settings,
            envoy_options=options,
            processor_args=processor_args,
            kv_events=kv_events,
        )
    return LocalGateway(replicas=3, time_scale=0.2, envoy_options=options, processor_args=processor_args)


def run_arm(
    arm: str,
    requests: int,
    workers: int,
    stream: bool,
    engine: str = "fake",
    processor_args: tuple[str, ...] = (),
    kv_events: bool = True,
) -> dict[str, Any]:
    """One arm on a fresh gateway: its timed requests' means."""
    with tempfile.TemporaryDirectory(prefix="extproc-exchanges-") as tmp:
        log = Path(tmp) / "access.jsonl"
        with _gateway(engine, log, processor_args, kv_events) as gw:
            url = swap_in_bare_processor(gw) if arm == "bare" else gw.url
            for i in range(WARMUP):
                _send(url, f"warm {i} " + "word " * 600, stream)

            def one(i: int) -> None:
                _send(url, f"{arm} {i % 8} " + "word " * 600 + str(i), stream)

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, range(requests)))
        # Read once Envoy has stopped (it writes the file as it exits); the timed requests only.
        timed = log.read_text().splitlines()[-requests:]
        kept = Path(tmp) / "timed.jsonl"
        kept.write_text("\n".join(timed) + "\n")
        return time_before_upstream(kept)


def main() -> None:
    """Parse the arguments, run each arm, print the means as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="ours,bare", help="ours, bare, or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--workers", type=int, default=1, help="clients sending at once")
    ap.add_argument("--stream", action="store_true", help="streamed completions")
    ap.add_argument("--hogs", type=int, default=0, help="busy loops beside the gateway")
    ap.add_argument("--engine", choices=("fake", "vllm"), default="fake")
    ap.add_argument("--no-kv-events", action="store_true", help="real engines: our processor without their KV events")
    ap.add_argument("--processor-arg", action="append", default=[], help="a flag for our processor (repeatable)")
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        out = {
            arm: run_arm(arm, args.requests, args.workers, args.stream, args.engine, tuple(args.processor_arg))
            for arm in args.arms.split(",")
        }
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(json.dumps({"setup": vars(args), "arms": out}, indent=1))


if __name__ == "__main__":
    main()
