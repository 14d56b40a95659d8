"""Does the gRPC path alone grow? The do-nothing ext_proc server (``extproc_lab.bench.bare_processor``)
behind real Envoy at a paced rate, its resident memory sampled every 10 s.

The soak (benchmarks/soak.md) saw our processor's RSS grow ~120 bytes a request after warm-up with
every bound held and a flat Python heap. This runs the same kind of load with no routing at all.

    .venv/bin/python benchmarks/grpc_memory.py [--minutes 6] [--rate 200]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from extproc_lab.bench.overhead import BARE, Wrk, swap_in_bare_processor
from extproc_lab.demo.fault_matrix import rss_bytes
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.soak import least_squares_slope

MIB = 2**20


def main() -> int:
    """Run the load, print the samples and the slope after a one-minute warm-up."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--rate", type=float, default=200.0)
    args = parser.parse_args()
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found (Debian package wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, LocalGateway(replicas=2, profile="instant") as gw:
        swap_in_bare_processor(gw)
        pid = gw.procs.procs[BARE].pid
        load = threading.Thread(target=Wrk(wrk, Path(tmp)).run, args=(gw.url, 8, 4, args.minutes * 60, args.rate))
        start = time.monotonic()
        load.start()
        samples: list[tuple[float, int]] = []
        while load.is_alive():
            samples.append((time.monotonic() - start, rss_bytes(pid) or 0))
            print(f"{samples[-1][0]:6.0f} s  {samples[-1][1] / MIB:6.1f} MiB", flush=True)
            time.sleep(10)
        load.join()
    warm = [s for s in samples if s[0] >= 60]
    slope = least_squares_slope([(t / 60, b / MIB) for t, b in warm])
    requests = args.rate * (warm[-1][0] - warm[0][0])
    growth = warm[-1][1] - warm[0][1]
    print(
        f"\nbare grpc.aio ext_proc, {args.rate:g} req/s for {args.minutes:g} min: RSS {warm[0][1] / MIB:.1f} MiB "
        f"after 60 s, {warm[-1][1] / MIB:.1f} MiB at the end; slope {slope:+.2f} MiB/min, "
        f"about {growth / requests:.0f} bytes a request"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
