"""The ``serve`` flags of the KV events (over the config file's ``kv_events:`` section)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import replace

from extproc.kvevents.hashing import HashAlgo
from extproc.kvevents.settings import KvEventSettings


def add_kv_event_flags(p: argparse.ArgumentParser) -> None:
    """``--tokenizer``, ``--lora-adapter``, ``--kv-events-listen``, ``--kv-events-port``, ``--kv-hash-*``."""
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="tokenize MODEL's prompts with DIR (tokenizer.json, tokenizer_config.json): its requests match vLLM's "
        "KV events (replicas publish with --replica NAME=HOST:PORT,kv_events=tcp://H:P[,kv_replay=tcp://H:P])",
    )
    p.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="ADAPTER=MODEL",
        help="requests naming ADAPTER are tokenized as MODEL's and hashed with the adapter's name, as vLLM",
    )
    p.add_argument("--kv-events-listen", metavar="ENDPOINT", help="bind one SUB endpoint replicas connect to")
    p.add_argument("--kv-events-port", type=int, metavar="PORT", help="discovered replicas publish on this port")
    p.add_argument("--kv-replay-port", type=int, metavar="PORT", help="discovered replicas answer replays here")
    p.add_argument("--kv-hash-algo", choices=[a.value for a in HashAlgo], help="the engines' prefix hash (sha256)")
    p.add_argument("--kv-hash-seed", metavar="SEED", help="the engines' PYTHONHASHSEED, if set")
    p.add_argument(
        "--kv-check-sample-rate",
        type=float,
        metavar="RATE",
        help="share of responses read for usage.prompt_tokens_details.cached_tokens to check predictions",
    )


def _pairs(base: Mapping[str, str], specs: Sequence[str] | None, flag: str, form: str) -> dict[str, str]:
    """``base`` with each ``KEY=VALUE`` of a repeated flag added; ValueError names the flag."""
    out = dict(base)
    for spec in specs or []:
        key, sep, value = spec.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag}: expected {form}, got {spec!r}")
        out[key] = value
    return out


def kv_event_overrides(settings: KvEventSettings, args: argparse.Namespace) -> KvEventSettings:
    """The config's section with the flags applied; ValueError names a bad flag."""
    tokenizers = _pairs(settings.tokenizers, getattr(args, "tokenizer", None), "--tokenizer", "MODEL=DIR")
    adapters = _pairs(settings.lora_adapters, getattr(args, "lora_adapter", None), "--lora-adapter", "ADAPTER=MODEL")
    changes: dict[str, object] = {"tokenizers": tokenizers, "lora_adapters": adapters}
    for flag, key in (
        ("kv_events_listen", "listen"),
        ("kv_events_port", "port"),
        ("kv_replay_port", "replay_port"),
        ("kv_hash_seed", "hash_seed"),
        ("kv_check_sample_rate", "check_sample_rate"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            changes[key] = value
    rate = changes.get("check_sample_rate")
    if rate is not None and not 0 <= float(rate) <= 1:  # type: ignore[arg-type]
        raise ValueError(f"--kv-check-sample-rate: between 0 and 1, got {rate}")
    algo = getattr(args, "kv_hash_algo", None)
    if algo:
        changes["hash_algo"] = HashAlgo(algo)
    return replace(settings, **changes)  # type: ignore[arg-type]
