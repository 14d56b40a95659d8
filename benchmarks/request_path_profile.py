"""Where our processor's CPU goes under ``extproc bench overhead``'s load: py-spy samples of the
processor while wrk drives Envoy -> processor -> two instant fake replicas, split by what the
sampled frame was doing.

    .venv/bin/python benchmarks/request_path_profile.py --seconds 20 --prompt-kb 8 > benchmarks/request_path_profile.md

py-spy (the dev extra) samples Python frames; time inside a C extension (grpcio's core, orjson,
xxhash) is charged to the Python frame that called it, so each category below includes the native
code it calls. grpcio's own C threads (its completion-queue pollers) are not Python threads and
show in no sample: the gap between the process's CPU and the samples' share is theirs, and is
printed as such.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from extproc_lab.bench.overhead import Wrk, cpu_seconds
from extproc_lab.demo.gateway import LocalGateway

# (category, markers in "function (file:line)" frames), tried from the innermost frame outwards:
# the first frame that matches one decides. Order matters where a file would match two.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "metrics (prometheus_client)",
        ("prometheus_client/", "extproc/observe/metrics.py", "extproc/adapters/telemetry.py"),
    ),
    ("body parsing (orjson, the OpenAI body)", ("orjson", "extproc/request/openai_body.py")),
    ("prefix hashing", ("extproc/request/prefix.py", "xxhash", "extproc/fleet/kvevents/hashing.py")),
    ("tokenizing", ("extproc/request/tokenizer.py", "tokenizers")),
    ("the decision (routing/)", ("extproc/routing/",)),
    (
        "cache view and bookkeeping",
        (
            "extproc/fleet/cache/",
            "extproc/core/bookkeeping.py",
            "extproc/fleet/health/replicas.py",
            "extproc/state/",
            "extproc/state/tenancy.py",
        ),
    ),
    ("features (other request/ work)", ("extproc/request/",)),
    ("the facade (router.py)", ("extproc/app/router.py",)),
    ("the ext_proc stream (server/)", ("extproc/adapters/server/",)),
    ("grpcio and protobuf (Python side)", ("grpc/", "google/protobuf", "_pb2", "envoy/", "xds/")),
    ("asyncio event loop", ("asyncio/", "selectors.py")),
)


IDLE = "waiting in epoll (idle)"
POLLER = "grpcio's poller thread"


def category(stack: str) -> str:
    """The category of one collapsed stack (frames outermost first, ``;``-separated)."""
    frames = stack.split(";")
    leaf = frames[-1]
    # grpc.aio's Cython callbacks run from the event loop with no Python frame of their own, and
    # its completion-queue poller is a Python thread that runs native code.
    if leaf.startswith("Handle._run "):
        return "grpcio: its Cython callbacks on the event loop"
    if frames[0].startswith("Thread._bootstrap"):
        return POLLER
    if "selectors.py" in leaf:
        return IDLE
    for frame in reversed(frames):
        for name, markers in CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return "other"


def profile(seconds: float, prompt_kb: int, connections: int, rate_hz: int, keep: Path | None = None) -> str:
    """Run the load and the sampler; the Markdown summary (``keep``: where to copy py-spy's raw stacks)."""
    wrk_bin, spy = shutil.which("wrk"), shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if wrk_bin is None or spy is None:
        raise SystemExit("needs wrk (Debian package) and py-spy (pip install py-spy: the dev extra)")
    with (
        tempfile.TemporaryDirectory(prefix="extproc-profile-") as tmp,
        LocalGateway(replicas=2, profile="instant") as gw,
    ):
        wrk = Wrk(wrk_bin, Path(tmp))
        wrk.run(gw.url, prompt_kb, connections, 3)  # warm up
        pid = gw.procs.procs[gw.processor_name()].pid
        raw = Path(tmp) / "stacks.txt"
        result: dict[str, dict[str, float]] = {}
        load = threading.Thread(target=lambda: result.update(run=wrk.run(gw.url, prompt_kb, connections, seconds)))
        cpu_before = cpu_seconds(pid)
        load.start()
        time.sleep(0.5)
        argv = [spy, "record", "-p", str(pid), "-d", str(max(1, int(seconds - 1))), "-r", str(rate_hz),
                "-f", "raw", "-o", str(raw), "--nonblocking"]  # fmt: skip
        subprocess.run(argv, capture_output=True, check=True, timeout=seconds + 60)
        load.join()
        cpu = cpu_seconds(pid) - cpu_before
        if keep is not None:
            shutil.copyfile(raw, keep)
        samples: Counter[str] = Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                samples[category(stack)] += int(count)
    idle, poller = samples.pop(IDLE, 0), samples.pop(POLLER, 0)
    total = sum(samples.values()) or 1
    requests = result["run"]["requests"]
    lines = [
        f"{prompt_kb} KB prompts, {connections} connections, {seconds:g} s: {result['run']['rps']:.0f} req/s; "
        f"processor CPU {cpu / requests * 1e6:.0f} us per request ({cpu / seconds:.2f} cores).",
        f"The event-loop thread was busy {total / rate_hz:.1f} s and waited in epoll {idle / rate_hz:.1f} s; "
        f"grpcio's poller thread showed in samples for {poller / rate_hz:.1f} s (native code, much of it "
        "waiting in its own poll: not split below).",
        "",
        "| where the event-loop thread was busy | share | us per request |",
        "|---|---|---|",
    ]
    for name, n in samples.most_common():
        lines.append(f"| {name} | {n / total:.1%} | {n / rate_hz / requests * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse the arguments and print the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here (for a flame graph)")
    args = p.parse_args()
    print(profile(args.seconds, args.prompt_kb, args.connections, args.rate, args.raw), end="")


if __name__ == "__main__":
    main()
