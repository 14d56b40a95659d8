"""``extproc bench``: ``routing`` (our routing against the peers' policies, in the simulator),
``overhead`` (Envoy with our processor beside the real peer routers, on loopback),
``realstack`` (a multi-turn workload through the real routers, each on fresh replicas),
``inference-perf`` (GIE's load generator through ours and Envoy's round robin) and
``objectives-ramp`` (latency objectives over a load ramp through real Envoy, judged by the client)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from extproc_lab.bench.policies import ALL
from extproc_lab.bench.workloads import WORKLOADS, WorkloadSpec
from extproc_lab.sim.traces import TRACES_ENV


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``bench`` and its ``routing`` and ``overhead`` sub-commands."""
    bench = sub.add_parser("bench", help="benchmarks (routing policies in the simulator; router overhead)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser(
        "routing",
        help="replay a workload or trace through our routing and the peers' policies, in the simulator",
        description="Every policy routes the same requests, through the router's own pipeline, to replica "
        "models on a virtual clock; one table, a JSON file and PNG plots.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default="multi-turn")
    src.add_argument("--trace", help="a Mooncake JSONL or Azure CSV trace file (gzipped or not)")
    p.add_argument("--traces-dir", help=f"where the named traces are (default: the packaged copy, or ${TRACES_ENV})")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--profile", default="llama-8b-h100", help="replica profile (llama-8b-h100, demo, instant)")
    p.add_argument("--rate", type=float, default=1.0, help="arrival-rate factor (2.0: twice the load)")
    p.add_argument("--slow-profile", default=None, help="a mixed pool: some replicas of this profile (llama-8b-a100)")
    p.add_argument(
        "--slow-replicas", type=int, default=None, help="how many replicas are of --slow-profile (default: half)"
    )
    p.add_argument(
        "--policies", default=",".join(ALL), help=f"comma-separated, in table order (default: {','.join(ALL)})"
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica (the profile's num_gpu_blocks)")
    p.add_argument(
        "--kv-blocks-sweep",
        default=None,
        metavar="N,N,...",
        help="run at each of these KV block counts per replica (e.g. 3000,6000,12000,27545); one table across levels",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="every request's time-to-first-token objective")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="every request's time-per-output-token objective")
    p.add_argument(
        "--slo-mix",
        default=None,
        metavar="NAME:SHARE:TTFT:TPOT,...",
        help="classes of conversations and their objectives in ms ('-': none), e.g. chat:0.7:300:40,batch:0.3:-:-"
        " (instead of --slo-ttft-ms/--slo-tpot-ms); adds SLO met and goodput to the table",
    )
    p.add_argument("--config", dest="router_config", help="router YAML config: its profile is the 'extproc' policy")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an extra policy from a YAML profile (or a router config's profile:), to try weights",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="policies simulated at once")
    p.add_argument("--json", dest="json_path", help="write the figures here")
    p.add_argument("--plots", dest="plots_dir", help="write PNG plots here (default: beside --json, else bench-out/)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_overhead_parser(kinds)
    _add_realstack_parser(kinds)
    _add_inference_perf_parser(kinds)
    _add_objectives_ramp_parser(kinds)
    return bench  # type: ignore[no-any-return]


def _add_overhead_parser(kinds: Any) -> None:
    from extproc_lab.bench.overhead import ROUTERS
    from extproc_lab.bench.peer_routers import PEERS_DIR_ENV

    p = kinds.add_parser(
        "overhead",
        help="Envoy alone, Envoy with our processor, sglang-router and vllm-router, in front of the same replicas",
        description="Throughput and latency of each router in turn, driven by wrk on this machine. The peer "
        "routers are pip-installed into venvs of their own on first use.",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="length of each measured run")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring each router")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--prompt-kb", type=int, default=8)
    p.add_argument("--large-kb", type=int, default=200, help="prompt size of the large-body run")
    p.add_argument("--rate", type=float, default=1000.0, help="requests/s of the paced latency run")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated (default: {','.join(ROUTERS)})")
    p.add_argument("--peers-dir", help=f"where the peer routers' venvs live (default: ${PEERS_DIR_ENV} or ~/.cache)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing peer routers")
    p.add_argument(
        "--no-observe", action="store_true", help="our processor skips the response-headers phase (docs/performance.md)"
    )
    p.add_argument("--processor-arg", action="append", default=[], help="an extra `extproc serve` argument")
    p.add_argument(
        "--sizes",
        default="",
        metavar="KB,KB,...",
        help="also sweep these prompt sizes (e.g. 1,8,64,200,1024): req/s, CPU per request, paced latency",
    )
    p.add_argument("--sweep-rate", type=float, default=100.0, help="requests/s of the sweep's paced runs")
    p.add_argument("--json", dest="json_path", help="write the figures here")


def _add_realstack_parser(kinds: Any) -> None:
    from extproc_lab.bench.agent_sessions import SMALL_AGENTS, AgentLoad
    from extproc_lab.bench.peer_routers import PEERS_DIR_ENV
    from extproc_lab.bench.realstack import (
        AGENT_DEFAULTS,
        ENGINES,
        ROUTERS,
        VLLM_DEFAULTS,
        VLLM_ROUTERS,
        WORKLOADS,
        RealStackSetup,
        ServeLoad,
    )

    d = RealStackSetup.__dataclass_fields__
    serve = ServeLoad.__dataclass_fields__
    p = kinds.add_parser(
        "realstack",
        help="a multi-turn chat workload through Envoy with our router, Envoy's round robin, sglang-router and "
        "vllm-router, each in front of freshly started fake replicas",
        description="Hit ratio (the replicas' own counters), client-side TTFT and requests per replica for each "
        "router in turn, on 127.0.0.1. The peer routers are pip-installed into venvs of their own on first use.",
    )

    def default(name: str) -> str:
        vllm = f", {VLLM_DEFAULTS[name]} with --engine vllm" if name in VLLM_DEFAULTS else ""
        return f"(default: {d[name].default}{vllm})"

    p.add_argument("--engine", choices=ENGINES, default="fake", help="fake replicas, or real vLLM CPU engines")
    agent = AgentLoad.__dataclass_fields__
    agent_defaults = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in AGENT_DEFAULTS.items())
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="chat",
        help="chat: the multi-turn conversations below; agents: the simulator's agent workload (long growing "
        "contexts, tool pauses, forks, keyless agents), with the reuse offered and captured "
        f"(defaults then: {agent_defaults}); vllm-bench: vLLM's own `vllm bench serve` client, its "
        "prefix_repetition dataset, no session key (--engine vllm)",
    )
    for flag, name, kind, what in (
        ("--num-prompts", "num_prompts", int, "requests"),
        ("--request-rate", "request_rate", float, "requests a second (Poisson)"),
        ("--prefix-len", "prefix_len", int, "tokens of each shared prefix"),
        ("--suffix-len", "suffix_len", int, "tokens of each request's own suffix"),
        ("--num-prefixes", "num_prefixes", int, "shared prefixes"),
    ):
        p.add_argument(
            flag, type=kind, default=serve[name].default, help=f"--workload vllm-bench: {what} (default %(default)s)"
        )
    p.add_argument(
        "--agents",
        type=int,
        default=None,
        help=f"agents (--workload agents; default {agent['agents'].default}, {SMALL_AGENTS.agents} with --engine "
        "vllm, whose agents are smaller: shorter harness, task and tool results, 4-6 turns)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="the agent workload's pace: agents start at 0.5/s x RATE, tool pauses average 2 s / RATE "
        f"(default {agent['rate'].default}, {SMALL_AGENTS.rate:g} with --engine vllm)",
    )
    p.add_argument("--profile", default=None, help="the fake replicas' timing profile (default: demo)")
    p.add_argument("--conversations", type=int, default=None, help=default("conversations"))
    p.add_argument("--turns", type=int, default=None, help=default("turns"))
    p.add_argument("--replicas", type=int, default=None, help=default("replicas"))
    p.add_argument("--system-tokens", type=int, default=d["system_tokens"].default, help="the shared system prompt")
    p.add_argument(
        "--document-tokens", type=int, default=d["document_tokens"].default, help="each first turn's document"
    )
    p.add_argument("--followup-tokens", type=int, default=d["followup_tokens"].default)
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"].default, help="tokens each answer streams")
    p.add_argument(
        "--stagger", type=float, default=None, help="seconds between conversations' arrivals " + default("stagger_s")
    )
    p.add_argument("--live", type=int, default=None, help="conversations in flight at most " + default("live"))
    p.add_argument(
        "--think", type=float, default=d["think_s"].default, help="mean seconds between a conversation's turns"
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: the demo profile's 1024; 128 with --engine vllm)",
    )
    p.add_argument(
        "--engine-model", default=d["engine_model"].default, choices=("tiny", "small"), help="with --engine vllm"
    )
    p.add_argument("--block-size", type=int, default=d["block_size"].default, help="the engines' (--engine vllm)")
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"].default, help="with --engine vllm")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument(
        "--routers",
        default=None,
        help=f"comma-separated (default: {','.join(ROUTERS)}; with --engine vllm: {','.join(VLLM_ROUTERS)}; "
        "on request: extproc_price, ours with the price profile, and extproc_duplex, ours behind full-duplex bodies)",
    )
    p.add_argument("--peers-dir", help=f"where the peer routers' venvs live (default: ${PEERS_DIR_ENV} or ~/.cache)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing peer routers")
    p.add_argument(
        "--run-timeout", type=float, default=d["run_timeout_s"].default, help="seconds a router's run may take"
    )
    p.add_argument("--processor-arg", action="append", default=[], help="an extra `extproc serve` argument")
    p.add_argument(
        "--price-config",
        metavar="FILE",
        help="YAML keys added to extproc_price's config, e.g. health.engine_rates (the engines' calibrated prior: "
        "benchmarks/routing/cpu-small-rates.yaml)",
    )
    p.add_argument("--log-dir", help="keep every process's log here, a folder per router (default: discarded)")
    p.add_argument("--json", dest="json_path", help="write the figures here")


def _add_inference_perf_parser(kinds: Any) -> None:
    from extproc_lab.bench.inference_perf import PYTHON_ENV, ROUTERS, WORKLOADS, InferencePerfSetup

    d = InferencePerfSetup.__dataclass_fields__
    p = kinds.add_parser(
        "inference-perf",
        help="GIE's inference-perf (multi-turn conversations, shared prefix) through our router and Envoy's "
        "round robin, each on freshly started fake replicas",
        description="inference-perf is pip-installed into a venv of its own on first use (Python 3.12+: "
        f"${PYTHON_ENV}); its configs are written to a temporary folder and its tokenizer is trained locally. "
        "KV hit ratio from the replicas' counters, TTFT and end-to-end latency from inference-perf, requests per "
        "replica and our decisions by reason.",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated (default: {','.join(WORKLOADS)})",
    )
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated (default: {','.join(ROUTERS)})")
    p.add_argument(
        "--session-tokens",
        default="",
        metavar="N,N,...",
        help="one more row of ours for each: the default profile with prefill_cost.session_tokens=N (opt-in; 0 by "
        "default)",
    )
    p.add_argument("--replicas", type=int, default=d["replicas"].default)
    p.add_argument("--conversations", type=int, default=d["conversations"].default, help="live at once")
    p.add_argument("--turns", type=int, default=d["turns"].default)
    p.add_argument("--rounds", type=int, default=d["rounds"].default, help="conversations each slot runs in turn")
    p.add_argument("--system-tokens", type=int, default=d["system_tokens"].default, help="the shared system prompt")
    p.add_argument(
        "--document-tokens", type=int, default=d["document_tokens"].default, help="each conversation's own prompt part"
    )
    p.add_argument("--turn-tokens", type=int, default=d["turn_tokens"].default, help="each turn's new input (mean)")
    p.add_argument("--output-tokens", type=int, default=d["output_tokens"].default, help="each answer (mean)")
    p.add_argument(
        "--think-max", type=int, default=d["think_max_s"].default, help="whole seconds between turns, uniform 0..N"
    )
    p.add_argument(
        "--no-session-header",
        action="store_true",
        help="conversations without x-session-id (inference-perf's default: no session_id_header_key)",
    )
    p.add_argument("--groups", type=int, default=d["groups"].default, help="shared prefixes (shared_prefix)")
    p.add_argument("--prompts-per-group", type=int, default=d["prompts_per_group"].default)
    p.add_argument("--prefix-tokens", type=int, default=d["prefix_tokens"].default)
    p.add_argument("--question-tokens", type=int, default=d["question_tokens"].default)
    p.add_argument("--prefix-output-tokens", type=int, default=d["prefix_output_tokens"].default)
    p.add_argument("--rate", type=float, default=d["rate"].default, help="requests per second (shared_prefix)")
    p.add_argument("--duration", type=int, default=d["duration_s"].default, help="seconds (shared_prefix)")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--venv", help="inference-perf's venv (default: ~/.cache/extproc/inference-perf)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install inference-perf when missing")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: one trained on the spot)")
    p.add_argument("--workers", type=int, default=d["workers"].default, help="inference-perf's worker processes")
    p.add_argument("--run-timeout", type=float, default=d["run_timeout_s"].default, help="seconds one run may take")
    p.add_argument("--processor-arg", action="append", default=[], help="an extra `extproc serve` argument")
    p.add_argument("--log-dir", help="keep configs, logs and inference-perf's reports here (default: discarded)")
    p.add_argument("--json", dest="json_path", help="write the figures here")


def _add_objectives_ramp_parser(kinds: Any) -> None:
    from extproc_lab.bench.objectives_ramp import DEFAULT_ROUTERS, ROUTERS, RampSetup

    d = RampSetup.__dataclass_fields__
    p = kinds.add_parser(
        "objectives-ramp",
        help="latency objectives over an open-loop load ramp through real Envoy, our router with and without "
        "objectives and Envoy's round robin, each on fresh fake replicas; met share and goodput by the client",
        description="Probe the fleet's capacity, then send LOADS x that, two classes of multi-turn chats "
        "(premium: loose objectives, never shed; standard: tighter, shed or queued), on 127.0.0.1.",
    )
    p.add_argument("--replicas", type=int, default=d["replicas"].default)
    p.add_argument(
        "--time-scale", type=float, default=d["time_scale"].default, help="the demo profile's speed (1.0: as written)"
    )
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in RampSetup().loads), help="factors of the capacity")
    p.add_argument("--seconds", type=float, default=d["seconds"].default, help="conversations arrive this long a load")
    p.add_argument("--turns", type=int, default=d["turns"].default)
    p.add_argument("--gap", type=float, default=d["gap_s"].default, help="seconds between a conversation's turns")
    p.add_argument("--kv-blocks", type=int, default=d["kv_blocks"].default, help="KV blocks (16 tokens) per replica")
    p.add_argument("--capacity", type=float, default=None, help="requests/s of the fleet (default: probed)")
    p.add_argument("--probe-seconds", type=float, default=d["probe_s"].default)
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help=f"comma-separated, of {','.join(ROUTERS)}")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--log-dir", help="keep every process's log here, a folder per router (default: discarded)")
    p.add_argument("--json", dest="json_path", help="write the figures here")


def run_inference_perf_command(args: argparse.Namespace) -> int:
    """Run ``extproc bench inference-perf``."""
    from extproc_lab.bench.inference_perf import (
        InferencePerfSetup,
        default_venv,
        format_table,
        per_replica_lines,
        run_inference_perf_bench,
    )

    def names(value: str) -> tuple[str, ...]:
        return tuple(v.strip() for v in value.split(",") if v.strip())

    try:
        session_tokens = tuple(int(v) for v in names(args.session_tokens))
    except ValueError:
        print(f"extproc bench: --session-tokens {args.session_tokens!r}: expected integers", file=sys.stderr)
        return 2
    setup = InferencePerfSetup(
        replicas=args.replicas,
        workloads=names(args.workloads),
        routers=names(args.routers),
        session_tokens=session_tokens,
        conversations=args.conversations,
        turns=args.turns,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        document_tokens=args.document_tokens,
        turn_tokens=args.turn_tokens,
        output_tokens=args.output_tokens,
        think_max_s=args.think_max,
        session_header=not args.no_session_header,
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        prefix_tokens=args.prefix_tokens,
        question_tokens=args.question_tokens,
        prefix_output_tokens=args.prefix_output_tokens,
        rate=args.rate,
        duration_s=args.duration,
        seed=args.seed,
        venv=Path(args.venv) if args.venv else default_venv(),
        install=not args.no_install,
        tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None,
        run_timeout_s=args.run_timeout,
        workers=args.workers,
        processor_args=tuple(args.processor_arg),
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    try:
        result = run_inference_perf_bench(setup, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    s = result["setup"]
    print(
        f"{s['inference_perf']}; {s['replicas']} x {s['profile']} fake replicas, fresh for each run. "
        f"conversations: {s['conversations']} live x {s['turns']} turns x {s['rounds']} rounds, "
        f"{s['system_tokens']}-token shared system prompt + {s['document_tokens']} of its own, "
        f"~{s['turn_tokens']} tokens a turn, ~{s['output_tokens']} out, 0-{s['think_max_s']} s between turns, "
        f"{'with' if s['session_header'] else 'without'} x-session-id. "
        f"shared_prefix: {s['groups']} groups x "
        f"{s['prompts_per_group']} prompts, {s['prefix_tokens']}-token prefixes + {s['question_tokens']}, "
        f"{s['prefix_output_tokens']} out, {s['rate']:g}/s for {s['duration_s']} s. Seed {s['seed']}.\n"
    )
    if "multi_turn_chat" in s["workloads"]:
        print(
            f"multi_turn_chat: {s['chat_groups']} groups x {s['chat_users']} users x {s['chat_turns']} turns, "
            f"{s['chat_prefix_tokens']}-token prefixes + {s['chat_question_tokens']}, ~{s['output_tokens']} out, "
            f"{s['chat_rate']:g}/s.\n"
        )
    print(format_table(result))
    print("\nrequests per replica (replica-0 first):")
    for line in per_replica_lines(result):
        print(f"  {line}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    failed = [
        f"{w}/{label}"
        for w, rows in result["runs"].items()
        for label, r in rows.items()
        if "error" in r or r["failures"]
    ]
    if failed:
        print(f"extproc bench: failed runs or requests: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_objectives_ramp_command(args: argparse.Namespace) -> int:
    """Run ``extproc bench objectives-ramp``."""
    from extproc_lab.bench.objectives_ramp import RampSetup, format_tables, run_ramp, verdict

    try:
        setup = RampSetup(
            replicas=args.replicas,
            time_scale=args.time_scale,
            loads=tuple(float(x) for x in args.loads.split(",") if x.strip()),
            seconds=args.seconds,
            turns=args.turns,
            gap_s=args.gap,
            kv_blocks=args.kv_blocks,
            capacity_rps=args.capacity,
            probe_s=args.probe_seconds,
            probe_warmup_s=min(RampSetup.__dataclass_fields__["probe_warmup_s"].default, args.probe_seconds / 3),
            routers=tuple(r.strip() for r in args.routers.split(",") if r.strip()),
            seed=args.seed,
            log_dir=Path(args.log_dir) if args.log_dir else None,
        )
        result = run_ramp(setup, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    how = "probed" if result["capacity_probed"] else "given"
    print(f"capacity {result['capacity_rps']:g} req/s ({how}); {result['wall_s']:g} s wall\n")
    print(format_tables(result))
    for line in verdict(result):
        print(f"  {line}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    failed = [name for name, r in result["routers"].items() if "error" in r]
    if failed:
        print(f"extproc bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_realstack_command(args: argparse.Namespace) -> int:
    """Run ``extproc bench realstack``."""
    from extproc_lab.bench.agent_sessions import SMALL_AGENTS, AgentLoad
    from extproc_lab.bench.envoy_log import format_envoy_table
    from extproc_lab.bench.follow_ups import summary
    from extproc_lab.bench.peer_routers import default_peers_dir
    from extproc_lab.bench.realstack import (
        AGENT_DEFAULTS,
        ROUTERS,
        VLLM_DEFAULTS,
        VLLM_ROUTERS,
        RealStackSetup,
        ServeLoad,
        format_table,
        run_realstack,
        verdict,
    )

    d = RealStackSetup.__dataclass_fields__
    vllm = args.engine == "vllm"

    agents = args.workload == "agents"

    def pick(value: Any, name: str) -> Any:
        """The flag's value, else the engine kind's (or the agent workload's) default."""
        if value is not None:
            return value
        if vllm and name in VLLM_DEFAULTS:
            return VLLM_DEFAULTS[name]
        return AGENT_DEFAULTS[name] if agents and not vllm and name in AGENT_DEFAULTS else d[name].default

    routers = args.routers or ",".join(VLLM_ROUTERS if vllm else ROUTERS)
    setup = RealStackSetup(
        conversations=pick(args.conversations, "conversations"),
        turns=pick(args.turns, "turns"),
        replicas=pick(args.replicas, "replicas"),
        system_tokens=args.system_tokens,
        document_tokens=args.document_tokens,
        followup_tokens=args.followup_tokens,
        max_tokens=args.max_tokens,
        stagger_s=pick(args.stagger, "stagger_s"),
        live=pick(args.live, "live"),
        think_s=args.think,
        kv_blocks=pick(args.kv_blocks, "kv_blocks"),
        seed=args.seed,
        routers=tuple(r.strip() for r in routers.split(",") if r.strip()),
        engine=args.engine,
        engine_model=args.engine_model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        peers_dir=Path(args.peers_dir) if args.peers_dir else default_peers_dir(),
        install=not args.no_install,
        run_timeout_s=args.run_timeout,
        processor_args=tuple(args.processor_arg),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        price_config=Path(args.price_config) if args.price_config else None,
        workload=args.workload,
        agents=dataclasses.replace(
            SMALL_AGENTS if vllm else AgentLoad(),
            **{k: v for k, v in (("agents", args.agents), ("rate", args.rate)) if v is not None},
        ),
        profile=pick(args.profile, "profile"),
        serve=ServeLoad(
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            num_prefixes=args.num_prefixes,
        ),
    )
    try:
        result = run_realstack(setup, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    s = result["setup"]
    if args.workload == "vllm-bench":
        print(
            f"{s['client']}; {s['replicas']} x {s['profile']} engines of {s['kv_tokens_per_replica']} KV tokens "
            f"(shared prefixes {s['workload_over_fleet_kv']:g}x the fleet's KV)\n"
        )
    elif agents:
        a = s["agent_workload"]
        print(
            f"agents: {a['shape']}; {a['requests']} requests ({a['keyless_requests']} keyless), prompts of "
            f"{a['mean_prompt_tokens']:g} tokens on average; {s['replicas']} x {s['profile']} replicas of "
            f"{s['kv_tokens_per_replica']} KV tokens (distinct prompt blocks {s['workload_over_fleet_kv']:g}x the "
            f"fleet's KV), seed {s['seed']}\n"
        )
    else:
        print(
            f"{s['conversations']} conversations x {s['turns']} turns, {s['system_tokens']}-token shared system "
            f"prompt, at most {s['live']} live; {s['replicas']} x {s['profile']} replicas of "
            f"{s['kv_tokens_per_replica']} KV tokens (workload {s['workload_over_fleet_kv']:g}x the fleet's KV), "
            f"seed {s['seed']}\n"
        )
    print(format_table(result))
    for line in verdict(result):
        print(f"  {line}")
    for name, figures in result["routers"].items():
        if (said := summary(name, figures)) is not None:
            print(f"  {said}")
    if envoy := format_envoy_table(result["routers"]):
        print(f"\n{envoy}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    failed = [name for name, r in result["routers"].items() if "error" in r or r["errors"]]
    if failed:
        print(f"extproc bench: failed or lost requests: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_overhead_command(args: argparse.Namespace) -> int:
    """Run ``extproc bench overhead``."""
    from extproc_lab.bench.overhead import OverheadSetup, format_sizes_table, format_table, run_overhead
    from extproc_lab.bench.peer_routers import default_peers_dir

    setup = OverheadSetup(
        seconds=args.seconds,
        warmup_s=args.warmup,
        connections=args.connections,
        prompt_kb=args.prompt_kb,
        large_kb=args.large_kb,
        rate=args.rate,
        routers=tuple(r.strip() for r in args.routers.split(",") if r.strip()),
        peers_dir=Path(args.peers_dir) if args.peers_dir else default_peers_dir(),
        install=not args.no_install,
        processor_args=tuple(args.processor_arg),
        observe_responses=not args.no_observe,
        sizes_kb=tuple(int(kb) for kb in args.sizes.split(",") if kb.strip()),
        sweep_rate=args.sweep_rate,
    )
    try:
        result = run_overhead(setup, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if setup.sizes_kb:
        print()
        print(format_sizes_table(result))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    failed = [name for name, r in result["routers"].items() if "error" in r]
    if failed:
        print(f"extproc bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    """Run ``extproc bench routing`` or ``extproc bench overhead``."""
    if getattr(args, "bench_command", "routing") == "overhead":
        return run_overhead_command(args)
    if getattr(args, "bench_command", "routing") == "realstack":
        return run_realstack_command(args)
    if getattr(args, "bench_command", "routing") == "inference-perf":
        return run_inference_perf_command(args)
    if getattr(args, "bench_command", "routing") == "objectives-ramp":
        return run_objectives_ramp_command(args)
    from extproc_lab.bench.plots import write_plots
    from extproc_lab.bench.routing import BenchSetup, format_table, run_bench, verdict
    from extproc_lab.sim.objectives import parse_mix, uniform

    variants = []
    for item in args.variant:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"extproc bench: --variant {item!r}: expected NAME=FILE", file=sys.stderr)
            return 2
        variants.append((name, path))
    try:
        objectives = parse_mix(args.slo_mix) if args.slo_mix else uniform(args.slo_ttft_ms, args.slo_tpot_ms)
    except ValueError as exc:
        print(f"extproc bench: --slo-mix: {exc}", file=sys.stderr)
        return 2
    spec = WorkloadSpec(
        name=args.workload,
        trace=args.trace,
        rate=args.rate,
        seed=args.seed,
        limit=args.limit,
        traces=args.traces_dir,
        objectives=objectives,
    )
    slow = args.slow_replicas if args.slow_replicas is not None else args.replicas // 2
    setup = BenchSetup(
        spec,
        args.replicas,
        args.profile,
        args.seed,
        args.router_config,
        tuple(variants),
        kv_blocks=args.kv_blocks,
        slow_profile=args.slow_profile,
        slow_replicas=slow if args.slow_profile else 0,
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    policies += [n for n, _ in variants if n not in policies]
    if args.kv_blocks_sweep:
        return _run_sweep_command(args, setup, policies)
    try:
        result = run_bench(setup, policies, jobs=args.jobs, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    w = result.workload
    print(
        f"\n{w['name']}: {w['requests']} requests, {w['sessions']} sessions, mean prompt {w['mean_prompt_tokens']:.0f} "
        f"tokens, mean output {w['mean_output_tokens']:.0f}; {args.replicas} x {args.profile}"
        f"{f' ({setup.slow_replicas} of them {args.slow_profile})' if args.slow_profile else ''}, rate x{args.rate:g}, "
        f"seed {args.seed} ({result.wall_s:.0f}s)\n"
    )
    print(format_table(result, markdown=args.markdown))
    for name, r in result.results.items():
        join = r.figures.get("join")
        if join:
            print(
                f"  {name}: scale-up at {join['at_s']:g}s: TTFT p99 {join['ttft_p99_before_s']:.3f}s in the minute"
                f" before, {join['ttft_p99_after_s']:.3f}s in the minute after (hit ratio"
                f" {join['hit_ratio_before']:.1%} -> {join['hit_ratio_after']:.1%})"
            )
    for line in verdict(result):
        print(f"  {line}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result.to_json(), indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    if not args.no_plots:
        directory = (
            Path(args.plots_dir)
            if args.plots_dir
            else Path(args.json_path).parent
            if args.json_path
            else Path("bench-out")
        )
        stem = Path(args.json_path).stem if args.json_path else spec.label
        paths = write_plots(result, directory, stem)
        if paths:
            print("plots: " + ", ".join(str(p) for p in paths))
        else:
            print("plots skipped: matplotlib is not installed (pip install 'extproc-router[bench]')")
    return 0


def _run_sweep_command(args: argparse.Namespace, setup: Any, policies: list[str]) -> int:
    """``--kv-blocks-sweep``: one run per level, one table across levels, the targets per level."""
    from extproc_lab.bench.pressure import format_sweep, parse_levels, run_sweep, sweep_verdict

    try:
        levels = parse_levels(args.kv_blocks_sweep)
        results = run_sweep(setup, levels, policies, jobs=args.jobs, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as exc:
        print(f"extproc bench: {exc}", file=sys.stderr)
        return 2
    w = results[0].workload
    walls = ", ".join(f"{r.workload['kv_blocks_per_replica']}: {r.wall_s:.0f}s" for r in results)
    print(
        f"\n{w['name']}: {w['requests']} requests, {w['sessions']} sessions, mean prompt {w['mean_prompt_tokens']:.0f} "
        f"tokens; {args.replicas} x {args.profile}, rate x{args.rate:g}, seed {args.seed} (wall {walls})\n"
    )
    print(format_sweep(results))
    for r in results:
        for line in sweep_verdict(r):
            print(f"  {line}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        payload = {"levels": [{"kv_blocks": lv, **r.to_json()} for lv, r in zip(levels, results, strict=True)]}
        Path(args.json_path).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"figures written to {args.json_path}")
    return 0
