"""Typed messages to plain data and YAML (each ``Any`` unpacked), as ``envoy`` reads them."""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import betterproto2
import yaml
from envoy_data_plane.google.protobuf import Struct

from extproc.adapters.envoy_config.bootstrap import bootstrap
from extproc.adapters.envoy_config.spec import GatewaySpec


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, datetime.timedelta):
        return f"{value.total_seconds():g}s"
    if isinstance(value, enum.Enum):
        return value.name
    return value


_struct_to_dict = Struct.to_dict


def _struct_as_plain_data(self: Struct, **kwargs: Any) -> Any:
    # betterproto2 0.9 asserts on a Struct built as a message (an access log's JSON format, once
    # its Any is unpacked) in Python output; a Struct's proto JSON is plain data already, the
    # same as its Python form.
    kwargs["output_format"] = betterproto2.OutputFormat.PROTO_JSON
    return _struct_to_dict(self, **kwargs)


Struct.to_dict = _struct_as_plain_data  # type: ignore[method-assign]


def to_dict(message: betterproto2.Message) -> dict[str, Any]:
    """A message as Envoy's YAML form: snake_case fields, ``@type`` in every ``Any``.

    Built from betterproto2's Python output rather than its proto JSON, which quotes 64-bit
    integers (``'5'``); durations become ``"1s"`` and enums their names. Fields at their proto3
    default (``priority: 0``, ``response_body_mode: NONE`` ...) are left out, as Envoy's own
    printer does; Envoy reads them as those defaults.
    """
    plain: dict[str, Any] = _plain(
        message.to_dict(casing=betterproto2.Casing.SNAKE, output_format=betterproto2.OutputFormat.PYTHON)
    )
    return plain


def render(spec: GatewaySpec) -> dict[str, Any]:
    """The bootstrap as a mapping (dump it with :func:`render_yaml`), the admin section first."""
    rendered = to_dict(bootstrap(spec))
    return {"admin": rendered.pop("admin"), **rendered}


class _Dumper(yaml.SafeDumper):
    """No ``&id001`` anchors: each repeated block is written out, as a person would."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Mapping[str, Any] | Sequence[Any]) -> str:
    """YAML text in the form of the files we ship (keys in proto field order, no anchors)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120)


def render_yaml(spec: GatewaySpec) -> str:
    """The bootstrap as YAML text."""
    return dump_yaml(render(spec))
