"""The ``serve`` flags that set config: one table, each flag a key of the file.

A flag's value goes into the file's mapping at its key before the mapping is validated, so a
flag is checked exactly as the key is and wins over the file; an error about a key a flag sets
names the flag too. ``extproc serve --help`` shows each flag's key.

Every flag is also an environment variable (:attr:`Flag.env`: ``EXTPROC_`` and the flag's name in
capitals, ``--metrics-listen`` is ``EXTPROC_METRICS_LISTEN``), made from the same table: a
variable is read only where its flag is not given, converted and checked as the flag is, and then
as the key is; a repeated flag's variable holds its values separated by whitespace. So the order
is flag, then environment, then file, then default.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from extproc.config import config_from_mapping, read_mapping
from extproc.config.model import Config, ConfigError, parse_replica, replica_entry
from extproc.kvevents.hashing import HashAlgo

Kind = Literal["value", "pairs", "replicas"]


def any_address_port(text: str) -> str:
    """A port number as GIE's picker flags give it, as the address it means: every interface."""
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"not a port: {text!r}")
    return f"0.0.0.0:{port}"


def cert_dir(text: str) -> dict[str, str]:
    """A directory holding ``tls.crt`` and ``tls.key`` (a mounted kubernetes.io/tls Secret, as GIE's
    ``--cert-path``), as ``grpc.tls``."""
    base = text.rstrip("/") or "/"
    return {"cert_file": f"{base}/tls.crt", "key_file": f"{base}/tls.key"}


def boolean(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``), as a flag's value."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag: its name, the file's key it sets (dotted), and how.

    ``value``: the key takes the flag's value. ``pairs``: a repeated ``KEY=VALUE`` flag adds to
    the key's mapping (``form`` names the two). ``replicas``: repeated ``--replica`` specs replace
    ``replicas:``. With ``switch`` (the section's ``enabled`` key), ``off`` turns the section off
    and any other value turns it on. With ``implies`` (a key and its value, the ``type`` of a
    section of several kinds), the flag also sets that key, starting the section afresh when the
    file's is of another kind.
    """

    name: str
    key: str
    help: str
    kind: Kind = "value"
    type: Callable[[str], Any] = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: str | None = None
    form: str = ""
    implies: tuple[str, str] | None = None

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        """The environment variable that stands for the flag when it is not given."""
        return env_name(self.name)


ENV_PREFIX = "EXTPROC_"


def env_name(flag: str) -> str:
    """The environment variable of a flag: ``--metrics-listen`` -> ``EXTPROC_METRICS_LISTEN``."""
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--listen", "listen", "HOST:PORT or unix:/path (default 127.0.0.1:9002)"),
    Flag(
        "--replica",
        "replicas",
        "a replica (repeatable); in cluster mode NAME is its Envoy cluster; its engines' KV events with "
        ",kv_events=tcp://H:P[,kv_replay=tcp://H:P][,kv_dp=N]",
        kind="replicas",
        metavar="NAME=HOST:PORT[,LABEL=VALUE...]",
    ),
    Flag("--mode", "mode", "cluster: a target-cluster header; endpoint: GIE's header", choices=("cluster", "endpoint")),
    Flag(
        "--pool-name",
        "discovery.name",
        "be this InferencePool's endpoint picker: follow the pool and the pods it selects (as GIE's picker)",
        metavar="NAME",
        implies=("discovery.type", "inference_pool"),
    ),
    Flag(
        "--pool-namespace",
        "discovery.namespace",
        "the InferencePool's namespace (default: the pod's own)",
        metavar="NAMESPACE",
        implies=("discovery.type", "inference_pool"),
    ),
    Flag(
        "--workers",
        "workers",
        "N processes serving the --listen port, sharing pins, prefix index and load in memory (default 1)",
        type=int,
        metavar="N",
    ),
    Flag(
        "--store",
        "store",
        "affinity store URL: memory:// (default), redis://, rediss://, unix://, redis+sentinel://, redis+cluster://",
    ),
    Flag(
        "--metrics-listen",
        "metrics.listen",
        "HOST:PORT for /metrics (default 127.0.0.1:9190), 'off' to disable",
        switch="metrics.enabled",
    ),
    Flag(
        "--response-sample-rate",
        "health.response_sample_rate",
        "share of requests whose response headers are observed (default 1)",
        type=float,
        metavar="R",
    ),
    Flag(
        "--health-listen",
        "grpc.health_listen",
        "also serve gRPC health alone, in plaintext, here (for probes)",
        metavar="HOST:PORT",
    ),
    Flag(
        "--tls-cert",
        "grpc.tls.cert_file",
        "PEM certificate chain: serve gRPC over TLS (with --tls-key)",
        metavar="FILE",
    ),
    Flag("--tls-key", "grpc.tls.key_file", "PEM private key of --tls-cert", metavar="FILE"),
    # GIE's picker flags where they mean the same (its chart's and its users' command lines).
    Flag(
        "--grpc-port",
        "listen",
        "GIE's name: ext_proc on this port of every interface (as --listen 0.0.0.0:PORT)",
        type=any_address_port,
        metavar="PORT",
    ),
    Flag(
        "--grpc-health-port",
        "grpc.health_listen",
        "GIE's name: plaintext gRPC health on this port of every interface",
        type=any_address_port,
        metavar="PORT",
    ),
    Flag(
        "--metrics-port",
        "metrics.listen",
        "GIE's name: /metrics on this port of every interface",
        type=any_address_port,
        metavar="PORT",
        switch="metrics.enabled",
    ),
    Flag(
        "--cert-path",
        "grpc.tls",
        "GIE's name: serve TLS with DIR/tls.crt and DIR/tls.key (a mounted kubernetes.io/tls Secret)",
        type=cert_dir,
        metavar="DIR",
    ),
    Flag(
        "--secure-serving",
        "grpc.secure_serving",
        "true: without --tls-cert, serve TLS with a self-signed certificate made at start (GIE's picker "
        "default); false: plaintext (default: true with --pool-name, else false)",
        type=boolean,
        metavar="BOOL",
    ),
    Flag(
        "--tls-client-ca",
        "grpc.tls.client_ca_file",
        "PEM CA bundle: require client certificates (mTLS)",
        metavar="FILE",
    ),
    Flag(
        "--admin-listen",
        "admin.listen",
        "the admin API on a port of its own (default: on the --listen port, docs/ports.md), 'off' to disable",
        metavar="HOST:PORT",
        switch="admin.enabled",
    ),
    Flag(
        "--tracing-endpoint",
        "tracing.endpoint",
        "decision spans to this OTLP/gRPC collector (turns tracing on), 'off' to disable",
        metavar="HOST:PORT",
        switch="tracing.enabled",
    ),
    Flag(
        "--tracing-sampler",
        "tracing.sampler",
        "ratio: tracing.sample_rate of every request, whatever its traceparent; parent_based: follow a sampled "
        "parent (Envoy's own tracing deciding)",
        choices=("ratio", "parent_based"),
    ),
    Flag("--admin-token-file", "admin.token_file", "bearer token for the admin API's mutating calls", metavar="FILE"),
    Flag(
        "--tokenizer",
        "kv_events.tokenizers",
        "tokenize MODEL's prompts with DIR (tokenizer.json, tokenizer_config.json): its requests match vLLM's "
        "KV events (repeatable)",
        kind="pairs",
        metavar="MODEL=DIR",
        form="MODEL=DIR",
    ),
    Flag(
        "--lora-adapter",
        "kv_events.lora_adapters",
        "requests naming ADAPTER are tokenized as MODEL's and hashed with the adapter's name, as vLLM (repeatable)",
        kind="pairs",
        metavar="ADAPTER=MODEL",
        form="ADAPTER=MODEL",
    ),
    Flag("--kv-events-listen", "kv_events.listen", "bind one SUB endpoint replicas connect to", metavar="ENDPOINT"),
    Flag("--kv-events-port", "kv_events.port", "discovered replicas publish on this port", type=int, metavar="PORT"),
    Flag(
        "--kv-replay-port", "kv_events.replay_port", "discovered replicas answer replays here", type=int, metavar="PORT"
    ),
    Flag(
        "--kv-hash-algo",
        "kv_events.hash_algo",
        "the engines' prefix hash (sha256)",
        choices=tuple(a.value for a in HashAlgo),
    ),
    Flag("--kv-hash-seed", "kv_events.hash_seed", "the engines' PYTHONHASHSEED, if set", metavar="SEED"),
    Flag(
        "--kv-check-sample-rate",
        "kv_events.check_sample_rate",
        "share of responses read for usage.prompt_tokens_details.cached_tokens to check predictions",
        type=float,
        metavar="RATE",
    ),
)

_TLS = ("--tls-cert", "--tls-key", "--tls-client-ca")


def add_config_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...] = SERVE_FLAGS) -> None:
    """Add ``flags`` to ``parser``, each help naming the key it sets."""
    for flag in flags:
        repeated = flag.kind in ("pairs", "replicas")
        parser.add_argument(
            flag.name,
            dest=flag.dest,
            action="append" if repeated else "store",
            default=[] if repeated else None,
            type=flag.type,
            metavar=flag.metavar,
            choices=flag.choices,
            help=f"{flag.help} [config {flag.key}; env {flag.env}]",
        )


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for name in sections:
        inner = raw.get(name)
        raw[name] = inner = dict(inner) if isinstance(inner, Mapping) else {}
        raw = inner
    raw[last] = value


def _get(raw: Mapping[str, Any], key: str) -> Any:
    for name in key.split("."):
        raw = raw.get(name) if isinstance(raw, Mapping) else None  # type: ignore[assignment]
    return raw


def _pairs(flag: Flag, base: Any, specs: list[str]) -> dict[str, Any]:
    out = dict(base) if isinstance(base, Mapping) else {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag.name}: expected {flag.form}, got {spec!r}")
        out[key] = value
    return out


def with_flags(
    raw: Mapping[str, Any], args: argparse.Namespace, flags: tuple[Flag, ...] = SERVE_FLAGS
) -> dict[str, Any]:
    """The file's mapping with the flags given in ``args`` set at their keys."""
    out = dict(raw)
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None or value == []:
            continue
        if flag.kind == "replicas":
            _set(out, flag.key, [replica_entry(parse_replica(spec)) for spec in value])
        elif flag.kind == "pairs":
            _set(out, flag.key, _pairs(flag, _get(out, flag.key), value))
        elif flag.switch is not None and value == "off":
            _set(out, flag.switch, False)
        else:
            if flag.implies is not None:
                key, kind = flag.implies
                if _get(out, key) != kind:
                    _set(out, key.rpartition(".")[0], {})
                    _set(out, key, kind)
            _set(out, flag.key, value)
            if flag.switch is not None:
                _set(out, flag.switch, True)
    tls = _get(out, "grpc.tls")
    if any(getattr(args, f.dest, None) for f in flags if f.name in _TLS) and not (
        isinstance(tls, Mapping) and tls.get("cert_file") and tls.get("key_file")
    ):
        raise ConfigError("--tls-cert and --tls-key: both are needed for TLS (--tls-client-ca adds mTLS)")
    return out


def _from_env(flag: Flag, text: str) -> Any:
    """A variable's value as its flag's would be: converted by the flag's type, among its choices."""
    repeated = flag.kind in ("pairs", "replicas")
    values = text.split() if repeated else [text.strip()]
    out = []
    for value in values:
        try:
            converted = flag.type(value)
        except ValueError:
            kinds = {int: "integer", float: "number", boolean: "boolean", any_address_port: "port"}
            kind = kinds.get(flag.type, "value")
            raise ConfigError(f"{flag.env}: not a valid {kind}: {value!r}") from None
        if flag.choices is not None and converted not in flag.choices:
            raise ConfigError(f"{flag.env}: expected one of {', '.join(flag.choices)}, got {value!r}")
        out.append(converted)
    return out if repeated else out[0]


def with_environment(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, flags: tuple[Flag, ...] = SERVE_FLAGS
) -> tuple[argparse.Namespace, dict[str, Flag]]:
    """``args`` with each flag not given taken from its environment variable (an empty variable
    counts as unset), and the flags so taken by their attribute; raises ConfigError naming the
    variable for a value its flag would refuse."""
    environ = os.environ if environ is None else environ
    out = argparse.Namespace(**vars(args))
    taken: dict[str, Flag] = {}
    for flag in flags:
        given = getattr(out, flag.dest, None)
        text = environ.get(flag.env, "")
        if (given is None or given == []) and text.strip():
            setattr(out, flag.dest, _from_env(flag, text))
            taken[flag.dest] = flag
    return out, taken


def _naming_flags(message: str, flags: tuple[Flag, ...], args: argparse.Namespace, from_env: Mapping[str, Flag]) -> str:
    """``message`` with each key a flag sets followed by that flag (or its variable): the one given
    where several set the key, else the first in the table. A key is matched whole (``listen`` is
    not the end of ``metrics.listen``)."""
    sources: dict[str, str] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        given = value is not None and value != []
        if given or flag.key not in sources:
            sources[flag.key] = flag.env if flag.dest in from_env else flag.name
    for key, source in sources.items():
        message = re.sub(rf"(?<![\w.]){re.escape(key)}:", f"{key} ({source}):", message)
    return message


def config_from_flags(
    path: str | Path | None,
    args: argparse.Namespace,
    flags: tuple[Flag, ...] = SERVE_FLAGS,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The config file at ``path`` (None: every default) with the environment over it and the
    flags over both, validated."""
    args, from_env = with_environment(args, environ, flags)
    raw = with_flags(read_mapping(path) if path else {}, args, flags)
    try:
        return config_from_mapping(raw)
    except ConfigError as exc:
        raise ConfigError(_naming_flags(str(exc), flags, args, from_env)) from None
