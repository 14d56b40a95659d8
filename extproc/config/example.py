"""``examples/router.yaml``: every key of :class:`~extproc.config.model.Config`, its default and
its one line of doc, dumped by PyYAML from the defaults and commented from the models."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from extproc.config.model import Config
from extproc.routing.registry import DEFAULT_PROFILE, REGISTRY

HEADER = """\
# extproc router config: every key, its default and what it does.
# Generated from the models of extproc/config (`make example-config`);
# tests/unit/config/test_config.py keeps the two equal. Every key is optional.
"""
COMMENT_COLUMN = 40


def _with_parameters(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` with each plugin's parameters spelled out at their defaults."""

    def spell(kind: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
        fields = dataclasses.fields(kind[spec["type"]])
        params = {f.name: f.default for f in fields if f.name != "name" and f.default is not dataclasses.MISSING}
        out = {k: v for k, v in spec.items() if k != "parameters"}
        return {**out, "parameters": params} if params else out

    return {
        "filters": [spell(REGISTRY.filters, f) for f in profile["filters"]],
        "scorers": [spell(REGISTRY.scorers, f) for f in profile["scorers"]],
        "picker": spell(REGISTRY.pickers, profile["picker"]),
    }


def example_values() -> dict[str, Any]:
    """The defaults as the file spells them, with examples where the default is empty."""
    values = Config().model_dump(mode="json")
    values["discovery"] = {"type": values["discovery"].pop("type"), **values["discovery"]}
    values["profile"] = _with_parameters(DEFAULT_PROFILE)
    values["replicas"] = [
        {"name": "replica-0", "address": "127.0.0.1:8001", "kv_events": "tcp://127.0.0.1:5557"},
        {"name": "replica-1", "address": "127.0.0.1:8002"},
        {"name": "replica-2", "address": "127.0.0.1:8003", "weight": 2},
    ]
    return values


class _FlowList(list[Any]):
    """A list written on one line."""


class _FlowMap(dict[str, Any]):
    """A mapping written on one line."""


class _Dumper(yaml.SafeDumper):
    """Sections one key a line; leaf lists and mappings (and list items) on one line each."""


_Dumper.add_representer(_FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_Dumper.add_representer(_FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True))


def _shaped(value: Any, default: Any) -> Any:
    """``value`` marked for the dumper: a section (``default`` a model) one key a line, a mapping
    holding collections likewise, any other collection on one line."""
    if isinstance(default, BaseModel):
        return {key: _shaped(item, getattr(default, key, None)) for key, item in value.items()}
    if isinstance(value, dict):
        if any(isinstance(v, dict | list) for v in value.values()):
            return {key: _shaped(item, None) for key, item in value.items()}
        return _FlowMap(value)
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return [_FlowMap(v) for v in value]
        return _FlowList(value)
    return value


def _docs(node: yaml.Node, default: Any) -> Iterator[tuple[int, str]]:
    """(line, doc) of every key in ``node`` that is a field of the model ``default`` is an
    instance of, recursively through sections and mappings of sections."""
    if not isinstance(node, yaml.MappingNode) or node.flow_style:
        return
    for key, value in node.value:
        name = key.value
        if isinstance(default, BaseModel):
            info = type(default).model_fields.get(name)
            if info is not None and info.description:
                yield key.start_mark.line, info.description
            yield from _docs(value, getattr(default, name, None))
        elif isinstance(default, Mapping) and isinstance(default.get(name), BaseModel):
            yield from _docs(value, default[name])


def example_yaml() -> str:
    """``examples/router.yaml``: the defaults, one key a line, each commented with its doc."""
    shaped = _shaped(example_values(), Config())
    text = yaml.dump(shaped, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    lines = text.splitlines()
    root = yaml.compose(text)
    assert root is not None  # the dump of a mapping
    for line, doc in _docs(root, Config()):
        lines[line] = f"{lines[line].ljust(COMMENT_COLUMN)}  # {doc}"
    return HEADER + "\n".join(lines) + "\n"
