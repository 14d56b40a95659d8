"""The ``kv_events:`` section of the router's config (and its flags)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.kvevents.hashing import HashAlgo

KEYS = {
    "listen",
    "port",
    "replay_port",
    "hash_algo",
    "hash_seed",
    "block_size",
    "stale_after_s",
    "speculative_ttl_s",
    "replay_timeout_s",
    "max_blocks_per_replica",
    "tokenizers",
    "unpin_below",
}


@dataclass(frozen=True, slots=True)
class KvEventSettings:
    """Where KV events come from and how blocks are keyed.

    Events are read from a replica when it has a ``kv_events`` endpoint (its ``--replica ...,
    kv_events=tcp://HOST:PORT[,kv_replay=tcp://HOST:PORT]`` labels), from every discovered replica
    when ``port`` is set (its address with that port; ``replay_port`` likewise), and from every
    replica that connects to ``listen``. They are used for requests to a model with a tokenizer.
    """

    listen: str | None = None
    port: int | None = None
    replay_port: int | None = None
    hash_algo: HashAlgo = HashAlgo.SHA256
    """The engines' ``--prefix-caching-hash-algo`` (sha256, sha256_cbor), or ``content`` when it
    cannot be reproduced (xxhash, or a random seed)."""
    hash_seed: str | None = None
    """The engines' PYTHONHASHSEED, if they set one."""
    block_size: int = 16
    stale_after_s: float = 5.0
    speculative_ttl_s: float = 2.0
    replay_timeout_s: float = 1.0
    max_blocks_per_replica: int = 1_000_000
    unpin_below: float = 0.5
    """A session stays pinned while its replica's events show it holding at least this fraction of
    the prompt's blocks (0: pins are always kept)."""
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    """Model name -> a directory with tokenizer.json and tokenizer_config.json."""

    @property
    def enabled(self) -> bool:
        """Whether any model is tokenized (without a tokenizer, events cannot be matched)."""
        return bool(self.tokenizers)


def _number(raw: Mapping[str, Any], key: str, default: float, minimum: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"kv_events.{key}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def kv_event_settings(raw: Mapping[str, Any] | None) -> KvEventSettings:
    """Validate the section; ValueError names the field."""
    if not raw:
        return KvEventSettings()
    if not isinstance(raw, Mapping):
        raise ValueError("kv_events: expected a mapping")
    unknown = set(raw) - KEYS
    if unknown:
        raise ValueError(f"kv_events: unknown keys {', '.join(sorted(unknown))}")
    d = KvEventSettings()
    try:
        algo = HashAlgo(raw.get("hash_algo", d.hash_algo))
    except ValueError:
        raise ValueError(
            f"kv_events.hash_algo: one of {', '.join(a.value for a in HashAlgo)}, got {raw.get('hash_algo')!r}"
        ) from None
    tokenizers = raw.get("tokenizers", {}) or {}
    if not isinstance(tokenizers, Mapping) or not all(isinstance(v, str) for v in tokenizers.values()):
        raise ValueError("kv_events.tokenizers: expected a mapping of model name to directory")
    ports = {}
    for key in ("port", "replay_port"):
        value = raw.get(key)
        if value is not None and (type(value) is not int or not 0 < value < 65536):
            raise ValueError(f"kv_events.{key}: expected a port number, got {value!r}")
        ports[key] = value
    listen = raw.get("listen")
    if listen is not None and (not isinstance(listen, str) or "://" not in listen):
        raise ValueError(f"kv_events.listen: expected a ZMQ endpoint such as tcp://0.0.0.0:5557, got {listen!r}")
    seed = raw.get("hash_seed")
    return KvEventSettings(
        listen=listen,
        port=ports["port"],
        replay_port=ports["replay_port"],
        hash_algo=algo,
        hash_seed=None if seed is None else str(seed),
        block_size=int(_number(raw, "block_size", d.block_size, 1)),
        stale_after_s=_number(raw, "stale_after_s", d.stale_after_s, 0.01),
        speculative_ttl_s=_number(raw, "speculative_ttl_s", d.speculative_ttl_s, 0),
        replay_timeout_s=_number(raw, "replay_timeout_s", d.replay_timeout_s, 0.01),
        max_blocks_per_replica=int(_number(raw, "max_blocks_per_replica", d.max_blocks_per_replica, 1)),
        unpin_below=_number(raw, "unpin_below", d.unpin_below, 0),
        tokenizers={str(k): str(v) for k, v in tokenizers.items()},
    )
