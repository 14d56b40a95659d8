"""The price's predicted time to first token against the client's, on real vLLM engines under load.

Two CPU engines of the lab's ``small`` model, the second calibrated alone (``extproc calibrate``),
both behind Envoy and the router with the price profile and that prior. Concurrent streaming
clients, each request's prediction read from the admin API's Explain for the replica the router
then chose (:mod:`extproc_lab.bench.price_accuracy`, the procedure the real-vLLM test runs with
fewer requests). Prints each run's median relative error, recorded in benchmarks/price.md.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/price_accuracy.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from extproc.api import cli_main as extproc
from extproc_lab.bench.price_accuracy import measure_cold_prompts, render, summarize
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.fleet import EngineSettings, VllmFleet

MODEL = "demo-model"
POOL = "cpu"
PRICE_PROFILE = Path(__file__).parent / "routing" / "price.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=14, help="streams per client and run")
    parser.add_argument("--warm-rounds", type=int, default=2, help="each client's first rounds, not counted")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="price-accuracy-"))
    settings = EngineSettings(model="small", block_size=32, num_blocks=256, max_model_len=2048)
    with VllmFleet(replicas=2, settings=settings, log_dir=tmp) as fleet:
        prior = tmp / "prior.yaml"
        url = fleet.url(fleet.members[1].name)
        if extproc(["calibrate", "--url", url, "--pool", POOL, "--out", str(prior)]) != 0:
            return 1
        calibrated = yaml.safe_load(prior.read_text())
        config = {
            "profile": yaml.safe_load(PRICE_PROFILE.read_text())["profile"],
            "health": {**calibrated["health"], "scrape_timeout_s": 1.0, "latency_models": "always"},
        }
        (tmp / "router.yaml").write_text(yaml.safe_dump(config))
        medians = []
        for run in range(args.runs):
            # A fresh router each run: its rates learnt from the prior again.
            gateway = LocalGateway(
                replicas=2,
                engines=fleet,
                labels={r.name: {"pool": POOL} for r in fleet.members},
                log_dir=tmp / f"run-{run}",
                processor_args=("--config", str(tmp / "router.yaml")),
            )
            with gateway:
                rows, decisions = measure_cold_prompts(
                    gateway.url,
                    gateway.admin_addresses[0],
                    MODEL,
                    clients=args.clients,
                    rounds=args.rounds,
                    warm_rounds=args.warm_rounds,
                )
            summary = summarize(rows)
            print(f"# run {run + 1}: {decisions} decisions")
            print(render(rows))
            print(f"# {summary}")
            medians.append(summary.median_error)
        print("median relative error per run:", " ".join(f"{m:.3f}" for m in medians))
        print(f"median over runs: {statistics.median(medians):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
