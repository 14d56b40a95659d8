"""The router's configuration: one YAML file, validated at start-up with messages that name the field.

Every value has a default, so ``extproc serve --replica a=127.0.0.1:8001`` works without a file.
The file's model is the runtime config (:mod:`extproc.config.model`); the ``serve`` flags and
the ``EXTPROC_*`` variables that set it are made from the model (:mod:`extproc.config.keys`,
:mod:`extproc.config.cli_flags`), and so are ``examples/router.yaml`` (:mod:`extproc.config.example`)
and docs/configuration.md's reference (:mod:`extproc.config.reference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from extproc.base.validation import describe
from extproc.config.errors import ConfigError
from extproc.config.model import Config, Mode
from extproc.config.replicas import REPLICA_KV_FIELDS, ReplicaEntry, parse_replica
from extproc.config.sections import (
    AdminSettings,
    Disaggregation,
    Grpc,
    Headers,
    ListenerTls,
    Metrics,
    Prefix,
    Request,
    Ring,
    Sessions,
    Spillover,
)
from extproc.fleet.discovery.settings import SOURCE_KINDS

__all__ = [
    "REPLICA_KV_FIELDS",
    "AdminSettings",
    "Config",
    "ConfigError",
    "Disaggregation",
    "Grpc",
    "Headers",
    "ListenerTls",
    "Metrics",
    "Mode",
    "Prefix",
    "ReplicaEntry",
    "Request",
    "Ring",
    "Sessions",
    "Spillover",
    "config_from_mapping",
    "load_config",
    "parse_replica",
    "read_mapping",
    "with_overrides",
]


def config_from_mapping(raw: Mapping[str, Any]) -> Config:
    """Validate a parsed YAML mapping into a :class:`Config`; :class:`ConfigError` names every bad field."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe(exc, tags=SOURCE_KINDS)) from None


def read_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML config file as the mapping it holds (empty: every default)."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("config: expected a mapping at the top level")
    return raw


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    return config_from_mapping(read_mapping(path))


def with_overrides(cfg: Config, **changes: Any) -> Config:
    """A copy with some top-level sections replaced (None: kept), validated again."""
    return Config(**{**dict(cfg), **{k: v for k, v in changes.items() if v is not None}})
