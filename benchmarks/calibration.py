"""``extproc calibrate`` on vLLM's CPU engines here: one engine of the lab's model ``--model``
(``tiny`` or ``small``, ``extproc_lab.engines``) started alone, calibrated, and stopped; the
``health.engine_rates`` entry it prints is recorded in benchmarks/calibration.md.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/calibration.py --model small
"""

from __future__ import annotations

import argparse
import sys

from extproc.api import cli_main as extproc
from extproc_lab.engines.fleet import EngineSettings, VllmFleet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="the lab's model size (tiny, small)")
    parser.add_argument("--pool", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = EngineSettings(model=args.model, block_size=32, max_model_len=2048, kv_events=False)
    with VllmFleet(replicas=1, settings=settings) as fleet:
        url = fleet.url(fleet.members[0].name)
        return extproc(["calibrate", "--url", url, "--pool", args.pool, "--repeats", str(args.repeats)])


if __name__ == "__main__":
    sys.exit(main())
