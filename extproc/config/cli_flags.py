"""The ``serve`` flags and the ``EXTPROC_*`` environment variables, both made from the config model.

Every key of the model (:mod:`extproc.config.keys`) is a flag and a variable by one naming rule:
``health.token_timing`` is ``--health-token-timing`` and ``EXTPROC_HEALTH__TOKEN_TIMING``. A value
is read by the key's type, put at its key, and the whole is validated as the file is, so a flag
or a variable is checked exactly as the key is; an error about a key names the flag or variable
that set it.

A few flags keep the names users already have (:data:`ALIASES`: GIE's picker flags, ``--replica``,
``--tokenizer``, ``--tls-cert``, ...): each sets a key of the model too, and its help is that key's
doc. They have no variables of their own: a key has one variable.

Order, highest first: a flag named after its key, a hand-named flag setting the same key, the
variable, the file, the default. An empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from extproc.config import config_from_mapping, read_mapping
from extproc.config.errors import ConfigError
from extproc.config.keys import ENV_PREFIX, Key, boolean, config_keys, key
from extproc.config.model import Config
from extproc.config.replicas import parse_replica, replica_entry

__all__ = [
    "ALIASES",
    "ENV_PREFIX",
    "SWITCHES",
    "Alias",
    "Key",
    "add_config_flags",
    "any_address_port",
    "boolean",
    "cert_dir",
    "config_from_flags",
    "env_name",
    "key_flag_names",
]

Kind = Literal["value", "pairs", "replicas"]

# Keys whose value 'off' turns their section off, and any other value on (a flag giving an
# address means it served there).
SWITCHES = {"metrics.listen": "metrics.enabled", "admin.listen": "admin.enabled", "tracing.endpoint": "tracing.enabled"}

# Variables of the command line itself (not keys of the file) and of the lab's tools: not typos.
COMMAND_VARIABLES = ("EXTPROC_CONFIG", "EXTPROC_LOG_LEVEL", "EXTPROC_LOG_FORMAT")


def env_name(flag: str) -> str:
    """The variable of a command-line option that is no key of the file: ``--log-level`` ->
    ``EXTPROC_LOG_LEVEL``."""
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


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


@dataclass(frozen=True, slots=True)
class Alias:
    """A flag named otherwise than its key, kept because users have it.

    ``value``: the key takes the flag's value, read by ``type`` (None: as the key reads it).
    ``pairs``: a repeated ``KEY=VALUE`` flag adds to the key's mapping (``form`` names the two).
    ``replicas``: repeated ``--replica`` specs replace ``replicas:``. With ``implies`` (a key and
    its value, the ``type`` of a section of several kinds) the flag also sets that key, starting
    the section afresh when the file's is of another kind. ``note`` is what the flag's own form
    adds to the key's doc.
    """

    name: str
    key: str
    note: str = ""
    kind: Kind = "value"
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    form: str = ""
    implies: tuple[str, str] | None = None

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def help(self) -> str:
        """The key's doc (and what the flag's form adds), naming the key."""
        doc = key(self.key).description if _is_key(self.key) else ""
        return "; ".join(part for part in (self.note, doc) if part) + f" [config {self.key}]"


def _is_key(path: str) -> bool:
    return any(k.path == path for k in config_keys())


_GIE = "GIE's picker's name"
ALIASES: tuple[Alias, ...] = (
    Alias(
        "--replica",
        "replicas",
        "one replica (repeatable); in cluster mode NAME is its Envoy cluster; its engines' KV events with "
        ",kv_events=tcp://H:P[,kv_replay=tcp://H:P][,kv_dp=N]",
        kind="replicas",
        metavar="NAME=HOST:PORT[,LABEL=VALUE...]",
    ),
    Alias(
        "--pool-name",
        "discovery.name",
        f"{_GIE}: be this InferencePool's endpoint picker (discovery type inference_pool)",
        metavar="NAME",
        implies=("discovery.type", "inference_pool"),
    ),
    Alias(
        "--pool-namespace",
        "discovery.namespace",
        f"{_GIE}: the InferencePool's namespace",
        metavar="NAMESPACE",
        implies=("discovery.type", "inference_pool"),
    ),
    Alias("--response-sample-rate", "health.response_sample_rate", metavar="R"),
    Alias("--health-listen", "grpc.health_listen", metavar="HOST:PORT"),
    Alias("--tls-cert", "grpc.tls.cert_file", "serve gRPC over TLS (with --tls-key)", metavar="FILE"),
    Alias("--tls-key", "grpc.tls.key_file", "the private key of --tls-cert", metavar="FILE"),
    Alias("--tls-client-ca", "grpc.tls.client_ca_file", "require client certificates (mTLS)", metavar="FILE"),
    Alias("--grpc-port", "listen", f"{_GIE}: on this port of every interface", type=any_address_port, metavar="PORT"),
    Alias(
        "--grpc-health-port",
        "grpc.health_listen",
        f"{_GIE}: on this port of every interface",
        type=any_address_port,
        metavar="PORT",
    ),
    Alias(
        "--metrics-port",
        "metrics.listen",
        f"{_GIE}: on this port of every interface",
        type=any_address_port,
        metavar="PORT",
    ),
    Alias(
        "--cert-path",
        "grpc.tls",
        f"{_GIE}: serve TLS with DIR/tls.crt and DIR/tls.key (a mounted kubernetes.io/tls Secret)",
        type=cert_dir,
        metavar="DIR",
    ),
    Alias("--secure-serving", "grpc.secure_serving", _GIE, metavar="BOOL"),
    Alias(
        "--tokenizer",
        "kv_events.tokenizers",
        "one MODEL=DIR (repeatable), added to the file's",
        kind="pairs",
        metavar="MODEL=DIR",
        form="MODEL=DIR",
    ),
    Alias(
        "--lora-adapter",
        "kv_events.lora_adapters",
        "one ADAPTER=MODEL (repeatable), added to the file's",
        kind="pairs",
        metavar="ADAPTER=MODEL",
        form="ADAPTER=MODEL",
    ),
    Alias("--kv-replay-port", "kv_events.replay_port", metavar="PORT"),
    Alias("--kv-hash-algo", "kv_events.hash_algo", metavar="ALGO"),
    Alias("--kv-hash-seed", "kv_events.hash_seed", metavar="SEED"),
    Alias("--kv-check-sample-rate", "kv_events.check_sample_rate", metavar="RATE"),
)

_TLS = ("--tls-cert", "--tls-key", "--tls-client-ca")


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError's message is the error argparse prints."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _escaped(text: str) -> str:
    return text.replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add the hand-named flags and a flag for every key of the model, grouped by section, each
    help naming its key's type, default and variable."""
    kept = parser.add_argument_group("flags kept by name (each sets a key of the file)")
    for alias in ALIASES:
        repeated = alias.kind in ("pairs", "replicas")
        parse = alias.type if alias.type is not None else (key(alias.key).parse if _is_key(alias.key) else str)
        kept.add_argument(
            alias.name,
            dest=alias.dest,
            action="append" if repeated else "store",
            default=[] if repeated else None,
            type=str if repeated else _argument_type(parse),
            metavar=alias.metavar,
            help=_escaped(alias.help),
        )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for k in config_keys():
        section = k.path.split(".")[0] if "." in k.path else "top level"
        group = groups.get(section)
        if group is None:
            group = groups[section] = parser.add_argument_group(f"config: {section}")
        within = f"; with type {', '.join(k.within)}" if k.within else ""
        group.add_argument(
            k.flag,
            dest=k.dest,
            default=argparse.SUPPRESS,
            type=_argument_type(k.parse),
            metavar=k.kind.upper() if not k.choices else "{" + ",".join(str(c) for c in k.choices) + "}",
            help=_escaped(f"{k.description} [{k.type_name}; default {k.default}{within}; env {k.env}]"),
        )


def _set(raw: dict[str, Any], path: str, value: Any) -> None:
    *sections, last = path.split(".")
    for name in sections:
        inner = raw.get(name)
        raw[name] = inner = dict(inner) if isinstance(inner, Mapping) else {}
        raw = inner
    raw[last] = value


def _get(raw: Mapping[str, Any], path: str) -> Any:
    for name in path.split("."):
        raw = raw.get(name) if isinstance(raw, Mapping) else None  # type: ignore[assignment]
    return raw


class _Layers:
    """The file's mapping with values put over it, remembering which flag or variable set each key."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = dict(raw)
        self.sources: dict[str, str] = {}

    def put(self, path: str, value: Any, source: str) -> None:
        switch = SWITCHES.get(path)
        if switch is not None and value == "off":
            _set(self.raw, switch, False)
        else:
            _set(self.raw, path, value)
            if switch is not None:
                _set(self.raw, switch, True)
        self.sources[path] = source

    def named(self, message: str) -> str:
        """``message`` with each path a flag or variable set followed by it (the longest key that
        is the path or holds it: ``replicas[0].address (--replica)``)."""
        parts = []
        for part in message.split("; "):
            path, sep, rest = part.partition(":")
            holders = [k for k in self.sources if path == k or path.startswith((f"{k}.", f"{k}["))]
            named = sep and holders and " " not in path
            parts.append(f"{path} ({self.sources[max(holders, key=len)]}):{rest}" if named else part)
        return "; ".join(parts)


def _from_environment(layers: _Layers, environ: Mapping[str, str]) -> None:
    for k in config_keys():
        text = environ.get(k.env, "")
        if text.strip():
            try:
                layers.put(k.path, k.parse(text), k.env)
            except ValueError as exc:
                raise ConfigError(f"{k.env}: {exc}") from None
    known = {k.env for k in config_keys()} | set(COMMAND_VARIABLES)
    for name in sorted(environ):
        # A typo (or a flag's name taken for a variable) would otherwise be silently ignored. Only
        # names of those shapes are refused: the lab's own EXTPROC_* variables are not ours to judge.
        if not environ[name].strip() or name in known:
            continue
        if name.startswith(ENV_PREFIX) and "__" in name:
            raise ConfigError(f"{name}: no such key of the config (docs/environment-variables.md)")
        alias = next((a for a in ALIASES if env_name(a.name) == name), None)
        if alias is not None:
            instead = f"; its key's is {key(alias.key).env}" if _is_key(alias.key) else ""
            raise ConfigError(f"{name}: {alias.name} is a flag kept by name, with no variable{instead}")
        named = next((k for k in config_keys() if env_name(k.flag) == name), None)
        if named is not None:  # the flag's name in capitals: a section's key needs its double underscore
            raise ConfigError(f"{name}: no such variable; {named.path}'s is {named.env}")


def _pairs(alias: Alias, base: Any, specs: list[str]) -> dict[str, Any]:
    out = dict(base) if isinstance(base, Mapping) else {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{alias.name}: expected {alias.form}, got {spec!r}")
        out[name] = value
    return out


def _from_aliases(layers: _Layers, args: argparse.Namespace) -> None:
    for alias in ALIASES:
        value = getattr(args, alias.dest, None)
        if value is None or value == []:
            continue
        if alias.kind == "replicas":
            layers.put(alias.key, [replica_entry(parse_replica(spec)) for spec in value], alias.name)
        elif alias.kind == "pairs":
            layers.put(alias.key, _pairs(alias, _get(layers.raw, alias.key), value), alias.name)
        else:
            if alias.implies is not None:
                path, kind = alias.implies
                if _get(layers.raw, path) != kind:
                    _set(layers.raw, path.rpartition(".")[0], {})
                    _set(layers.raw, path, kind)
            layers.put(alias.key, value, alias.name)
    tls = _get(layers.raw, "grpc.tls")
    if any(getattr(args, a.dest, None) for a in ALIASES if a.name in _TLS) and not (
        isinstance(tls, Mapping) and tls.get("cert_file") and tls.get("key_file")
    ):
        raise ConfigError("--tls-cert and --tls-key: both are needed for TLS (--tls-client-ca adds mTLS)")


def _from_key_flags(layers: _Layers, args: argparse.Namespace) -> None:
    for k in config_keys():
        if hasattr(args, k.dest):
            layers.put(k.path, getattr(args, k.dest), k.flag)


def config_from_flags(
    path: str | Path | None, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Config:
    """The config file at ``path`` (None: every default) with the variables over it and the flags
    over both, validated as one file."""
    layers = _Layers(read_mapping(path) if path else {})
    _from_environment(layers, os.environ if environ is None else environ)
    _from_aliases(layers, args)
    _from_key_flags(layers, args)
    try:
        return config_from_mapping(layers.raw)
    except ConfigError as exc:
        raise ConfigError(layers.named(str(exc))) from None


def key_flag_names() -> set[str]:
    """Every flag made from a key (the hand-named ones aside)."""
    return {k.flag for k in config_keys()}
