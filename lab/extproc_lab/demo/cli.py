"""``extproc demo``: our routing against Envoy's round robin on a multi-turn workload."""

from __future__ import annotations

import argparse
from typing import Any


def add_demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` sub-command."""
    p = sub.add_parser("demo", help="run Envoy, the processor and fake replicas, replay a workload, compare")
    p.add_argument(
        "--engine",
        choices=("fake", "vllm"),
        default="fake",
        help="fake replicas, or real vLLM CPU engines (installed under ~/.cache/extproc on first use)",
    )
    p.add_argument("--replicas", type=int, default=None, help="default 8 (3 with --engine vllm)")
    p.add_argument("--sessions", type=int, default=None, help="default 24 (12 with --engine vllm)")
    p.add_argument("--turns", type=int, default=None, help="default 8 (4 with --engine vllm)")
    p.add_argument("--stagger", type=float, default=0.1, help="seconds between conversation starts")
    p.add_argument("--mode", choices=["cluster", "endpoint"], default="cluster")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", dest="json_path", default=None, help="write the figures as JSON here")
    return p  # type: ignore[no-any-return]


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo (implemented in :mod:`extproc_lab.demo.run`)."""
    from extproc_lab.demo.run import run_demo

    return run_demo(args)
