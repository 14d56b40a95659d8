"""``extproc bench inference-perf``: GIE's benchmark tool against our gateway and Envoy's round robin.

inference-perf (the Gateway API Inference Extension's load generator, a PyPI package) runs from a
venv of its own (``~/.cache/extproc/inference-perf``, created with a Python 3.12+ and pip the first
time), never imported here: this module writes its YAML configs, runs it as a process and reads its
``summary_lifecycle_metrics.json``. Two of its own workloads:

- ``conversations``: its ``conversation_replay`` generator, multi-turn conversations whose system
  prompt starts with one shared part (then a document of each conversation's own), each turn
  resending the growing history, a fixed number of conversations live at once (``concurrent``
  load; a slot that finishes a conversation starts a new one), a pause of 0 to 2 s between turns,
  every request carrying ``x-session-id`` (unless told not to: inference-perf sends none by default);
- ``shared_prefix``: its ``shared_prefix`` generator, groups of prompts that share a system prompt,
  sent at a constant rate;
- ``multi_turn_chat``: the same generator with ``enable_multi_turn_chat``, each user
  of a group a conversation that starts from the group's prefix and sends its prompt (prefix and
  question) again each turn after the history, at a constant rate, with ``x-session-id``.

Each (router, workload) runs on a fleet of its own: fake replicas (``extproc replica --profile
demo``) started afresh, then our processor and Envoy (:class:`~extproc_lab.demo.gateway.LocalGateway`,
as ``bench realstack`` starts them); ours is reached through Envoy's ext_proc listener, round robin
through the same Envoy's plain listener. Figures: the KV hit ratio from the replicas' own counters
(``vllm:prefix_cache_hits_total`` over ``queries_total``, deltas over the run), TTFT and end-to-end
latency (to the last streamed token) from inference-perf's per-request report, requests per
replica (``request_success_total`` deltas) and our processor's decisions by reason (deltas of its
/metrics).

Nothing is downloaded: inference-perf needs a Hugging Face tokenizer to make prompts of a given
length, and gets one trained here in a second (:func:`build_tokenizer`) whose random token ids
decode to about 4 bytes a token, the fake replicas' count, so a prompt's length reads about the
same to both.
"""

from __future__ import annotations

import asyncio
import copy
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.api import SCORES_PROFILE
from extproc_lab.bench.realstack import OURS, ROUND_ROBIN, RealStackSetup, read_counters, read_decisions, start_router
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.install import engines_dir
from extproc_lab.stats import percentile

PACKAGE = "inference-perf"
VERSION = "0.7.0"
PYTHON_ENV = "EXTPROC_INFERENCE_PERF_PYTHON"
"""A Python 3.12+ to create inference-perf's venv with (it requires 3.12)."""
MODEL = "demo-model"
PROFILE = "demo"
SESSION_HEADER = "x-session-id"
CONVERSATIONS = "conversations"
SHARED_PREFIX = "shared_prefix"
MULTI_TURN_CHAT = "multi_turn_chat"
WORKLOADS = (CONVERSATIONS, SHARED_PREFIX, MULTI_TURN_CHAT)
ROUTERS = (OURS, ROUND_ROBIN)
_HITS, _QUERIES, _DONE = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
_INSTALL_TIMEOUT_S = 1200
# The tokenizer's vocabulary: with 700 entries over these pseudo-words a random token decodes to
# about 4 bytes, the fake replicas' bytes per token.
_TOKENIZER_VOCAB = 700


def default_venv() -> Path:
    """``~/.cache/extproc/inference-perf`` (beside the vLLM and peer routers' venvs)."""
    return engines_dir() / PACKAGE


@dataclass(frozen=True, slots=True)
class InferencePerfSetup:
    """Both workloads, the fleet, the routers, and where inference-perf lives."""

    replicas: int = 8
    workloads: tuple[str, ...] = WORKLOADS
    routers: tuple[str, ...] = ROUTERS
    session_tokens: tuple[int, ...] = ()
    """For each value, one more row of ours with ``prefill_cost.session_tokens`` set to it."""
    # conversations (conversation_replay): these many live at once, each `turns` long, about the
    # fleet's KV cache in all (48 x ~2,800 tokens against 8 x 16,384).
    conversations: int = 48
    turns: int = 8
    rounds: int = 1
    """Conversations each slot runs in turn. inference-perf replays a slot's conversation with the
    same prompts under a new session id, so a second round is no new conversation to a cache."""
    system_tokens: int = 600
    """The system prompt every conversation starts with."""
    document_tokens: int = 800
    """Each conversation's own part of its system prompt (inference-perf's dynamic system prompt)."""
    turn_tokens: int = 150
    """Each turn's new input, on average (normal, 30% spread)."""
    output_tokens: int = 32
    """Each answer, on average (uniform from half to one and a half times)."""
    session_header: bool = True
    """Send each conversation's session id as ``x-session-id`` (inference-perf's
    ``api.session_id_header_key``; it sends none unless told)."""
    think_max_s: int = 2
    """Whole seconds between an answer and the next turn, uniform from 0 to this (inference-perf
    takes whole seconds). Varied so that conversations do not move in lockstep: with fixed pauses
    and as many conversations as a multiple of the replicas, round robin sends every turn of a
    conversation to the same replica by accident."""
    # shared_prefix: groups x prompts_per_group prompts, sent at `rate` for `duration_s`.
    groups: int = 32
    prompts_per_group: int = 16
    prefix_tokens: int = 1500
    question_tokens: int = 150
    prefix_output_tokens: int = 32
    rate: float = 20.0
    duration_s: int = 30
    # multi_turn_chat: chat_groups x chat_users conversations of chat_turns turns, at chat_rate; a
    # conversation grows by its prompt and answer each turn (~5,000 tokens after 6 turns). Request i
    # is user i % users' next turn, so Envoy's round robin sends a user's turns to replicas `users`
    # apart: an odd count, or a multiple of the replicas would keep every user on one by accident.
    chat_groups: int = 5
    chat_users: int = 7
    chat_turns: int = 6
    chat_prefix_tokens: int = 600
    chat_question_tokens: int = 100
    chat_rate: float = 7.0
    seed: int = 7
    venv: Path = field(default_factory=default_venv)
    install: bool = True
    tokenizer_dir: Path | None = None
    """A Hugging Face tokenizer directory for inference-perf (default: one trained in the run's folder)."""
    run_timeout_s: float = 240.0
    workers: int = 1
    """inference-perf's worker processes (on 2 cores, more only compete with the fleet)."""
    processor_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    """Where each run's processes, configs and inference-perf's reports are kept (default: discarded)."""

    def check(self) -> None:
        """``ValueError`` for a setup that cannot run."""
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
        bad = [r for r in self.routers if r not in ROUTERS]
        if bad:
            raise ValueError(f"unknown routers {bad}; known: {', '.join(ROUTERS)}")
        counts = (self.replicas, self.conversations, self.turns, self.rounds, self.groups, self.prompts_per_group)
        if min(counts) < 1 or min(self.turn_tokens, self.output_tokens, self.prefix_output_tokens, self.duration_s) < 2:
            raise ValueError("replicas, conversations, turns, rounds, groups and prompts must be >= 1; lengths >= 2")
        if (
            self.rate <= 0
            or min(self.think_max_s, self.system_tokens, self.document_tokens) < 0
            or self.run_timeout_s <= 0
        ):
            raise ValueError("the rate and run timeout must be positive, the think time not negative")
        if any(t < 0 for t in self.session_tokens):
            raise ValueError("--session-tokens must not be negative")

    def rows(self) -> list[tuple[str, int | None]]:
        """Every router row: (router, session_tokens for ours' variants, else None)."""
        out: list[tuple[str, int | None]] = [(r, None) for r in self.routers]
        if OURS in self.routers:
            out += [(OURS, t) for t in self.session_tokens]
        return out


def row_label(router: str, session_tokens: int | None) -> str:
    """A row's name: the router, or ours with the session cost it was given."""
    return router if session_tokens is None else f"{router} (session_tokens={session_tokens})"


# --- inference-perf's venv ------------------------------------------------------------------------


def _runs(python: str) -> bool:
    """Whether ``python`` starts and is 3.12 or later (a pyenv shim for another version fails)."""
    try:
        done = subprocess.run(
            [python, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def base_python() -> str:
    """A Python 3.12+ for the venv: ``$EXTPROC_INFERENCE_PERF_PYTHON``, this one if new enough,
    ``python3.12``/``python3.13`` on the path, or a pyenv-installed 3.12/3.13."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    candidates = [sys.executable, *(shutil.which(n) or "" for n in ("python3.12", "python3.13"))]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for pattern in ("3.12*", "3.13*"):
        candidates += sorted(glob.glob(f"{pyenv_root}/versions/{pattern}/bin/python"))
    for python in candidates:
        if python and _runs(python):
            return python
    raise RuntimeError(f"{PACKAGE} needs Python 3.12 or later: none found (set ${PYTHON_ENV})")


def executable(venv: Path) -> Path:
    """The ``inference-perf`` command in the venv."""
    return venv / "bin" / PACKAGE


def ensure_installed(venv: Path, install: bool = True, progress: Callable[[str], None] = print) -> Path:
    """The ``inference-perf`` command, pip-installing the pinned release into ``venv`` first when it
    is missing (a stamp file marks a complete install). RuntimeError when it cannot."""
    stamp = venv / ".installed"
    if stamp.exists() and executable(venv).exists():
        return executable(venv)
    if not install:
        raise RuntimeError(f"{PACKAGE} is not installed in {venv} (run without --no-install)")
    progress(f"installing {PACKAGE}=={VERSION} into {venv} (a few minutes the first time)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    py = str(venv / "bin" / "python")
    steps = [
        [base_python(), "-m", "venv", "--clear", str(venv)],
        [py, "-m", "pip", "install", "--quiet", f"{PACKAGE}=={VERSION}"],
    ]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"installing {PACKAGE}=={VERSION} failed: {' '.join(argv)}\n{tail}")
    stamp.write_text(f"{PACKAGE}=={VERSION}\n")
    return executable(venv)


# --- the tokenizer ---------------------------------------------------------------------------------


def build_tokenizer(directory: Path, seed: int = 0) -> Path:
    """Train a byte-level BPE on pseudo-words and write a Hugging Face tokenizer directory (what
    ``transformers.AutoTokenizer`` loads: ``tokenizer.json``, ``tokenizer_config.json``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No byte alphabet beyond the corpus's letters: a random id then decodes to letters, not stray bytes.
    trainer = trainers.BpeTrainer(vocab_size=_TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "model_max_length": 1 << 20,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory


# --- configs ----------------------------------------------------------------------------------------


def _fixed(value: float) -> dict[str, Any]:
    """inference-perf's distribution of one value."""
    return {"type": "fixed", "mean": value, "min": int(value), "max": int(value), "std_dev": 0}


def _common(setup: InferencePerfSetup, url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(out)}},
        "report": {
            # Per request, its token times (not its bodies): the end-to-end time to the last token.
            "request_lifecycle": {
                "summary": True,
                "per_stage": False,
                "per_request": True,
                "per_request_fields": {"request": False, "response": False, "response_chunks": False, "info": True},
            },
            "prometheus": None,
            "session_lifecycle": {"summary": False, "per_stage": False},
        },
    }


def conversations_config(setup: InferencePerfSetup, url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """inference-perf's config for the multi-turn workload (``conversation_replay``, concurrent)."""
    cfg = _common(setup, url, tokenizer, out)
    if setup.session_header:
        cfg["api"]["session_id_header_key"] = SESSION_HEADER
    turn, answer = setup.turn_tokens, setup.output_tokens
    replay: dict[str, Any] = {
        "seed": setup.seed,
        "num_conversations": setup.conversations,
        "shared_system_prompt_len": setup.system_tokens,
        "turns_per_conversation": _fixed(setup.turns),
        "input_tokens_per_turn": {"type": "normal", "mean": turn, "std_dev": 0.3 * turn, "min": turn // 4,
                                  "max": 2 * turn},
        "output_tokens_per_turn": {"type": "uniform", "min": answer // 2, "max": answer + answer // 2,
                                   "mean": answer,
                                   "std_dev": 0},
    }  # fmt: skip
    if setup.document_tokens:
        replay["dynamic_system_prompt_len"] = _fixed(setup.document_tokens)
    if setup.think_max_s:
        replay["tool_call_latency_sec"] = {"type": "uniform", "min": 0, "max": setup.think_max_s, "mean": 1,
                                           "std_dev": 0}  # fmt: skip
    cfg["data"] = {"type": "conversation_replay", "conversation_replay": replay}
    requests = setup.conversations * setup.turns * setup.rounds
    cfg["load"] = {
        "type": "concurrent",
        "stages": [{"num_requests": requests, "concurrency_level": setup.conversations}],
        "num_workers": setup.workers,
        "worker_max_concurrency": max(100, setup.conversations),
        "base_seed": setup.seed,
        "request_timeout": 60,
    }
    return cfg


def shared_prefix_config(setup: InferencePerfSetup, url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """inference-perf's config for the shared-prefix workload (``shared_prefix``, constant rate)."""
    cfg = _common(setup, url, tokenizer, out)
    cfg["data"] = {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": setup.groups,
            "num_prompts_per_group": setup.prompts_per_group,
            "system_prompt_len": setup.prefix_tokens,
            "question_len": setup.question_tokens,
            "output_len": setup.prefix_output_tokens,
            "seed": setup.seed,
        },
    }
    cfg["load"] = {
        "type": "constant",
        "stages": [{"rate": setup.rate, "duration": setup.duration_s}],
        "num_workers": setup.workers,
        "base_seed": setup.seed,
        "request_timeout": 60,
    }
    return cfg


def multi_turn_chat_config(setup: InferencePerfSetup, url: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """inference-perf's config for its shared-prefix multi-turn chat (``enable_multi_turn_chat``)."""
    cfg = _common(setup, url, tokenizer, out)
    cfg["api"]["session_id_header_key"] = SESSION_HEADER
    cfg["data"] = {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": setup.chat_groups,
            "num_prompts_per_group": setup.chat_users,
            "system_prompt_len": setup.chat_prefix_tokens,
            "question_len": setup.chat_question_tokens,
            "output_len": setup.output_tokens,
            "seed": setup.seed,
            "enable_multi_turn_chat": True,
        },
    }
    requests = setup.chat_groups * setup.chat_users * setup.chat_turns
    cfg["load"] = {
        "type": "constant",
        "stages": [{"rate": setup.chat_rate, "duration": max(1, round(requests / setup.chat_rate))}],
        "num_workers": setup.workers,
        "base_seed": setup.seed,
        "request_timeout": 60,
    }
    return cfg


CONFIGS: dict[str, Callable[[InferencePerfSetup, str, Path, Path], dict[str, Any]]] = {
    CONVERSATIONS: conversations_config,
    SHARED_PREFIX: shared_prefix_config,
    MULTI_TURN_CHAT: multi_turn_chat_config,
}


def session_cost_config(session_tokens: int) -> dict[str, Any]:
    """A router config: the scores profile (the default today) with ``prefill_cost.session_tokens``
    set (opt-in, 0 by default)."""
    profile = copy.deepcopy(SCORES_PROFILE)  # its prefill_cost scorer carries the knob
    for scorer in profile["scorers"]:
        if scorer["type"] == "prefill_cost":
            scorer["parameters"] = {**scorer.get("parameters", {}), "session_tokens": session_tokens}
    return {"profile": profile}


# --- one run ----------------------------------------------------------------------------------------


def run_inference_perf(exe: Path, config: Path, log: Path, timeout_s: float) -> int:
    """Run inference-perf on ``config`` (its own process group, ended by its id on timeout); its exit code."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(exe), "--config_file", str(config)], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise TimeoutError(f"{PACKAGE} did not finish within {timeout_s:.0f}s (log: {log})") from None


def _stat(block: dict[str, Any] | None, key: str) -> float:
    value = (block or {}).get(key)
    return round(float(value), 4) if value is not None else 0.0


def summary_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """inference-perf's own summary: requests, failures, its TTFT and request latency, cached tokens.

    Its request latency ends when the request's handler returns, which in ``conversation_replay``
    is after the pause before the next turn (the "tool call" it sleeps through holding the
    session): :func:`request_figures` measures to the last token instead."""
    ok = summary.get("successes") or {}
    failed = summary.get("failures") or {}
    latency = ok.get("latency") or {}
    ttft, e2e = latency.get("time_to_first_token"), latency.get("request_latency")
    prompt = ok.get("prompt_tokens") or {}
    total = float(prompt.get("total") or 0.0)
    return {
        "requests": int(ok.get("count") or 0) + int(failed.get("count") or 0),
        "failures": int(failed.get("count") or 0),
        "failure_labels": sorted((failed.get("by_label") or {}).keys())[:3],
        "inference_perf": {
            "ttft_p50_s": _stat(ttft, "median"),
            "ttft_p99_s": _stat(ttft, "p99"),
            "request_latency_p50_s": _stat(e2e, "median"),
            "request_latency_p99_s": _stat(e2e, "p99"),
        },
        # usage.prompt_tokens_details.cached_tokens as inference-perf summed it: the cross-check.
        "client_hit_ratio": round(float(prompt.get("cached") or 0.0) / total, 4) if total else 0.0,
        "benchmark_s": round(float(summary.get("benchmark_time_seconds") or 0.0), 2),
    }


def request_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT (first streamed token) and end-to-end time (last token) of the answered requests, from
    inference-perf's per-request report (its token times, relative to each request's start)."""
    ttfts, e2es = [], []
    for r in records:
        times = ((r.get("info") or {}).get("response_metrics") or {}).get("output_token_times") or []
        if r.get("error") or not times:
            continue
        ttfts.append(times[0] - r["start_time"])
        e2es.append(times[-1] - r["start_time"])
    return {
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "e2e_p50_s": round(percentile(e2es, 0.5), 4),
        "e2e_p99_s": round(percentile(e2es, 0.99), 4),
        "timed": len(ttfts),
    }


def fleet_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The replicas' own account: hit ratio and requests per replica over the run."""
    delta = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    hits = sum(d[_HITS] for d in delta.values())
    queries = sum(d[_QUERIES] for d in delta.values())
    per_replica = {name: round(d[_DONE]) for name, d in delta.items()}
    return {
        "hit_ratio": round(hits / queries, 4) if queries else 0.0,
        "requests_per_replica": per_replica,
        "replicas_used": sum(1 for n in per_replica.values() if n > 0),
    }


def _decision_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        kind: {k: round(v - before.get(kind, {}).get(k, 0.0)) for k, v in sorted(counts.items())}
        for kind, counts in after.items()
    }


def run_one(
    setup: InferencePerfSetup,
    workload: str,
    router: str,
    session_tokens: int | None,
    exe: Path,
    tokenizer: Path,
    work: Path,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One workload through one router on a fleet of its own, every process ended afterwards."""
    label = row_label(router, session_tokens)
    folder = work / f"{workload}-{label.replace(' ', '').replace('(', '-').replace(')', '').replace('=', '')}"
    folder.mkdir(parents=True, exist_ok=True)
    processor_args = setup.processor_args
    if session_tokens is not None:
        router_config = folder / "router.yaml"
        router_config.write_text(yaml.safe_dump(session_cost_config(session_tokens), sort_keys=False))
        processor_args = (*processor_args, "--config", str(router_config))
    gw = LocalGateway(replicas=setup.replicas, profile=PROFILE, processor_args=processor_args, log_dir=folder)
    try:
        # realstack's start: fresh replicas, then (for ours) the processor, then Envoy; a chat answered.
        url = start_router(gw, router, RealStackSetup(replicas=setup.replicas, routers=(router,)))
        config = folder / "inference-perf.yaml"
        config.write_text(yaml.safe_dump(CONFIGS[workload](setup, url, tokenizer, folder / "report"), sort_keys=False))
        progress(f"{label} / {workload}: {PACKAGE} through {url}")
        before = asyncio.run(read_counters(gw))
        decisions_before = asyncio.run(read_decisions(gw.metrics_url)) if router == OURS else {}
        started = time.perf_counter()
        code = run_inference_perf(exe, config, folder / "inference-perf.log", setup.run_timeout_s)
        wall = time.perf_counter() - started
        # A replica counts a request as finished just after its last byte; let the counters settle.
        time.sleep(0.2)
        after = asyncio.run(read_counters(gw))
        report = folder / "report"
        summary_path, per_request_path = (
            report / "summary_lifecycle_metrics.json",
            report / "per_request_lifecycle_metrics.json",
        )
        if code != 0 or not summary_path.exists() or not per_request_path.exists():
            tail = "\n".join((folder / "inference-perf.log").read_text(errors="replace").splitlines()[-8:])
            raise RuntimeError(f"{PACKAGE} exited {code} without a summary:\n{tail}")
        row = {
            **summary_figures(json.loads(summary_path.read_text())),
            **request_figures(json.loads(per_request_path.read_text())),
            **fleet_figures(before, after),
            "wall_s": round(wall, 1),
        }
        if router == OURS:
            row["processor"] = _decision_delta(decisions_before, asyncio.run(read_decisions(gw.metrics_url)))
        if session_tokens is not None:
            row["router_config"] = session_cost_config(session_tokens)
        return row
    finally:
        gw.stop()


def run_inference_perf_bench(setup: InferencePerfSetup, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Install inference-perf if missing, then every workload through every router row, each on
    fresh replicas; the figures by workload and row."""
    setup.check()
    exe = ensure_installed(setup.venv, setup.install, progress)
    with tempfile.TemporaryDirectory(prefix="extproc-inference-perf-") as tmp:
        work = setup.log_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = setup.tokenizer_dir or build_tokenizer(work / "tokenizer", seed=setup.seed)
        runs: dict[str, dict[str, Any]] = {}
        for workload in setup.workloads:
            runs[workload] = {}
            for router, session_tokens in setup.rows():
                label = row_label(router, session_tokens)
                try:
                    row = run_one(setup, workload, router, session_tokens, exe, tokenizer, work, progress)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    row = {"error": str(exc)}
                runs[workload][label] = row
                progress(f"{label} / {workload}: {json.dumps(row)}")
    return {"runs": runs, "setup": describe(setup)}


def describe(setup: InferencePerfSetup) -> dict[str, Any]:
    """The setup as JSON."""
    s = asdict(setup)
    s["venv"] = str(setup.venv)
    s["tokenizer_dir"] = str(setup.tokenizer_dir) if setup.tokenizer_dir else None
    s["log_dir"] = str(setup.log_dir) if setup.log_dir else None
    s["inference_perf"] = f"{PACKAGE}=={VERSION}"
    s["profile"] = PROFILE
    return s


# --- the table ----------------------------------------------------------------------------------------


def _spread(per_replica: dict[str, int]) -> str:
    counts = [n for _, n in sorted(per_replica.items(), key=lambda kv: _replica_index(kv[0]))]
    return f"{min(counts)} / {max(counts)} ({sum(1 for n in counts if n)} of {len(counts)} used)" if counts else "-"


def _replica_index(name: str) -> tuple[int, str]:
    suffix = name.rpartition("-")[2]
    return (int(suffix), name) if suffix.isdigit() else (1 << 30, name)


def _reasons(row: dict[str, Any]) -> str:
    decisions = (row.get("processor") or {}).get("decisions") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(decisions.items(), key=lambda kv: -kv[1]) if v) or "-"


def format_table(result: dict[str, Any], order: Sequence[str] = WORKLOADS) -> str:
    """Markdown, one row per workload and router."""
    lines = [
        "| workload | router | requests (failed) | KV hit | client hit | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 "
        "| requests per replica min / max | our decisions by reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in order:
        for label, r in (result["runs"].get(workload) or {}).items():
            if "error" in r:
                first = r["error"].splitlines()[0][:120] if r["error"] else "failed"
                lines.append(f"| {workload} | {label} | failed: {first} |" + " |" * 8)
                continue
            lines.append(
                f"| {workload} | {label} | {r['requests']} ({r['failures']}) | {r['hit_ratio']:.1%} "
                f"| {r['client_hit_ratio']:.1%} | {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s "
                f"| {r['e2e_p50_s']:.3f} s | {r['e2e_p99_s']:.3f} s | {_spread(r['requests_per_replica'])} "
                f"| {_reasons(r)} |"
            )
    return "\n".join(lines)


def per_replica_lines(result: dict[str, Any]) -> list[str]:
    """Requests per replica in replica order, one line per run."""
    out = []
    for workload, rows in result["runs"].items():
        for label, r in rows.items():
            if "error" not in r:
                counts = " ".join(
                    str(n) for _, n in sorted(r["requests_per_replica"].items(), key=lambda kv: _replica_index(kv[0]))
                )
                out.append(f"{workload} / {label}: {counts}")
    return out
