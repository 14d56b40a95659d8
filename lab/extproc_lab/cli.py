"""The lab's sub-commands of ``extproc``: ``replica``, ``demo`` and ``bench``.

The router's command line finds them through the ``extproc.commands`` entry point this package
declares, so they exist exactly when the lab is installed; the router never imports the lab.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from extproc_lab.bench.cli import add_bench_parser, run_bench_command
from extproc_lab.demo.cli import add_demo_parser, run_demo_command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the lab's sub-commands; each sets ``run``, the function that carries it out."""
    _replica_parser(sub).set_defaults(run=run_replica_command)
    add_demo_parser(sub).set_defaults(run=run_demo_command)
    add_bench_parser(sub).set_defaults(run=run_bench_command)


def _replica_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("replica", help="run a fake vLLM replica (OpenAI API, /metrics, prefix cache)")
    p.add_argument("--name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", default="demo")
    p.add_argument("--model", default="demo-model")
    p.add_argument("--time-scale", type=float, default=None, help="1.0 real time, 0.1 ten times faster")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks (the profile's num_gpu_blocks overridden)")
    p.add_argument(
        "--kv-transfer-ms-per-block",
        type=float,
        default=None,
        help="time a decode hop takes to pull one KV block from a prefill replica (the profile's overridden)",
    )
    p.add_argument(
        "--sidecar-port",
        type=int,
        default=None,
        help="also serve a fake of llm-d's routing sidecar on this port, in front of this replica",
    )
    p.add_argument(
        "--sidecar-prefill-timeout-s",
        type=float,
        default=30.0,
        help="the sidecar's bound on a prefill hop, after which it decodes without it",
    )
    p.add_argument("--lora-adapters", default="", metavar="A,B", help="LoRA adapters loaded at start (comma-separated)")
    p.add_argument("--max-lora", type=int, default=None, help="LoRA adapter slots (default: one per --lora-adapters)")
    p.add_argument(
        "--no-lora-on-demand",
        dest="lora_on_demand",
        action="store_false",
        help="answer 404 for adapters not in --lora-adapters instead of loading them by name",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="tokenize prompts as vLLM does; cache keyed by vLLM's block hashes"
    )
    p.add_argument("--kv-events", metavar="ENDPOINT", help="publish KV events here, as vLLM (binds * and ipc://)")
    p.add_argument("--kv-replay", metavar="ENDPOINT", help="answer event replays here (a ROUTER socket)")
    p.add_argument("--kv-events-encoding", choices=["map", "array"], default="map", help="vLLM 0.33 maps, or arrays")
    p.add_argument("--prefix-caching-hash-algo", choices=["sha256", "sha256_cbor"], default="sha256")
    p.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=0,
        metavar="N",
        help="N KV blocks of CPU memory behind the cache, as vLLM's offloading connector (events with medium CPU)",
    )
    return p


def run_replica_command(args: argparse.Namespace) -> int:
    """Run ``extproc replica`` until SIGTERM/SIGINT."""
    from extproc_lab.replica import serve_replica

    adapters = tuple(a for a in args.lora_adapters.split(",") if a)
    if args.max_lora is not None and (args.max_lora < 0 or (adapters and args.max_lora == 0)):
        print("extproc replica: --max-lora must be >= 1 with --lora-adapters, and never negative", file=sys.stderr)
        return 2
    if args.kv_blocks is not None and args.kv_blocks < 1:
        print("extproc replica: --kv-blocks must be at least 1", file=sys.stderr)
        return 2
    if args.kv_transfer_ms_per_block is not None and args.kv_transfer_ms_per_block < 0:
        print("extproc replica: --kv-transfer-ms-per-block must not be negative", file=sys.stderr)
        return 2
    if args.cpu_offload_blocks < 0:
        print("extproc replica: --cpu-offload-blocks must not be negative", file=sys.stderr)
        return 2
    if args.sidecar_prefill_timeout_s <= 0:
        print("extproc replica: --sidecar-prefill-timeout-s must be positive", file=sys.stderr)
        return 2
    replica = serve_replica(
        args.name,
        args.host,
        args.port,
        args.profile,
        args.model,
        args.time_scale,
        lora_adapters=adapters,
        max_lora=args.max_lora,
        lora_on_demand=args.lora_on_demand,
        tokenizer_dir=args.tokenizer,
        kv_events=args.kv_events,
        kv_replay=args.kv_replay,
        kv_events_encoding=args.kv_events_encoding,
        hash_algo=args.prefix_caching_hash_algo,
        kv_blocks=args.kv_blocks,
        kv_transfer_s_per_block=(
            None if args.kv_transfer_ms_per_block is None else args.kv_transfer_ms_per_block / 1000
        ),
        cpu_offload_blocks=args.cpu_offload_blocks,
    )
    asyncio.run(_until_signalled(_with_sidecar(replica, args)))
    return 0


async def _with_sidecar(replica: Coroutine[Any, Any, None], args: argparse.Namespace) -> None:
    """The replica, and its sidecar when ``--sidecar-port`` asks for one."""
    if args.sidecar_port is None:
        await replica
        return
    from extproc_lab.replica.sidecar import serve_sidecar

    decode_url = f"http://{args.host}:{args.port}"
    sidecar = serve_sidecar(args.host, args.sidecar_port, decode_url, args.sidecar_prefill_timeout_s)
    await asyncio.gather(replica, sidecar)


async def _until_signalled(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` until it ends or SIGTERM/SIGINT arrives, then cancel it (its cleanup runs)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
