"""Every setting of the config model as a key, walked from the model itself.

A key is a field that holds a value rather than a section: ``health.limits.queue_full``,
``kv_events.tokenizers``, ``classes``. Each has an environment variable and a flag named by one
rule, and a parser from text; the ``serve`` flags, the variables and the reference in
docs/configuration.md are all made from :func:`config_keys`, so a field added to any section is
settable and documented with nothing else to write.

The naming rule: the variable is ``EXTPROC_`` and the key's path in capitals with ``__`` between
sections (``health.limits.queue_full`` is ``EXTPROC_HEALTH__LIMITS__QUEUE_FULL``); the flag is the
path with ``-`` for both dots and underscores (``--health-limits-queue-full``).

A value in text is read by the field's type: a string as it is, an integer, a number, a boolean
(``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``), one of a field's choices, and
``null`` where the field may be null; a list or mapping (``replicas``, ``classes``,
``kv_events.tokenizers``) is YAML (flow style fits one line: ``{a: /models/a}``). The value is then
put at its key and the whole is validated by the model, as a file's would be.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import yaml
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from extproc.config.model import Config

ENV_PREFIX = "EXTPROC_"
Kind = Literal["string", "integer", "number", "boolean", "yaml"]
_SCALARS: dict[type, Kind] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def boolean(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``) as a boolean."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True, slots=True)
class Key:
    """One setting: its dotted path, how its text is read, its default and its doc.

    ``within`` names the kinds of a section of several kinds (``discovery``'s ``type``) that have
    the key; empty where every kind has it or the section has one kind.
    """

    path: str
    kind: Kind
    description: str
    default: str
    choices: tuple[Any, ...] = ()
    nullable: bool = False
    within: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        """``EXTPROC_HEALTH__LIMITS__QUEUE_FULL``."""
        return ENV_PREFIX + "__".join(part.upper() for part in self.path.split("."))

    @property
    def flag(self) -> str:
        """``--health-limits-queue-full``."""
        return "--" + self.path.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's attribute on parsed arguments (apart from any hand-named flag's)."""
        return "key__" + self.path.replace(".", "__")

    @property
    def type_name(self) -> str:
        """The value's type as the reference shows it."""
        if self.choices:
            name = "one of " + ", ".join(str(c) for c in self.choices)
        else:
            name = {"yaml": "YAML"}.get(self.kind, self.kind)
        return name + (" or null" if self.nullable else "")

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for, or ValueError saying what was expected."""
        value = text.strip()
        if self.nullable and value == "null":
            return None
        if self.kind == "yaml":
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(f"not valid YAML ({exc.__class__.__name__}): {text!r}") from None
        try:
            if self.kind == "boolean":
                out: Any = boolean(value)
            elif self.kind == "integer":
                out = int(value)
            elif self.kind == "number":
                out = float(value)
            else:
                out = value
        except ValueError:
            names = {"boolean": "boolean (true or false)", "integer": "integer", "number": "number"}
            raise ValueError(f"not a valid {names[self.kind]}: {text!r}") from None
        if self.choices and out not in self.choices:
            raise ValueError(f"expected one of {', '.join(str(c) for c in self.choices)}, got {text!r}")
        return out


def _members(annotation: Any) -> list[Any]:
    """A union's members (one for anything else); an ``Annotated`` type stays whole."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's value is a section of (several for a section of several kinds), or []."""
    members = [m for m in _members(_unannotated(annotation)) if m is not type(None)]
    if members and all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return members
    return []


def _unannotated(annotation: Any) -> Any:
    """``Annotated[X, constraints]`` as X; a type read through a converter (``held_as``) stays."""
    if typing.get_origin(annotation) is typing.Annotated:
        inner, *meta = typing.get_args(annotation)
        if all(isinstance(m, FieldInfo) or type(m).__module__.startswith("annotated_types") for m in meta):
            return _unannotated(inner)
    return annotation


def _read_as(annotation: Any) -> tuple[Kind, tuple[Any, ...], bool]:
    """How a field's text is read: the kind, the choices, whether null is allowed."""
    members = _members(_unannotated(annotation))
    nullable = type(None) in members
    rest = [_unannotated(m) for m in members if m is not type(None)]
    if len(rest) == 1:
        (only,) = rest
        if typing.get_origin(only) is Literal:
            choices = typing.get_args(only)
            kinds = {_SCALARS.get(type(c)) for c in choices}
            if len(kinds) == 1 and None not in kinds:
                return kinds.pop(), choices, nullable  # type: ignore[return-value]
        elif isinstance(only, type) and issubclass(only, enum.Enum):
            return "string", tuple(m.value for m in only), nullable
        elif only in _SCALARS:
            return _SCALARS[only], (), nullable
    return "yaml", (), nullable


def _shown(annotation: Any, value: Any) -> str:
    """A default as the reference shows it: as the file spells it, on one line."""
    if value is PydanticUndefined:
        return "required"
    dumped = TypeAdapter(annotation).dump_python(value, mode="json")
    if isinstance(dumped, str):
        return dumped
    text = yaml.safe_dump(dumped, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").strip()


def _field_default(info: FieldInfo) -> Any:
    return info.default if info.default_factory is None else info.default_factory()  # type: ignore[call-arg]


def _kind_of(model: type[BaseModel]) -> str | None:
    """A section kind's name: its ``type`` field's one literal value (None for a plain section)."""
    info = model.model_fields.get("type")
    if info is None or typing.get_origin(info.annotation) is not Literal:
        return None
    (name,) = typing.get_args(info.annotation)
    return str(name)


def _keys_of(model: type[BaseModel], default: Any, prefix: str = "") -> dict[str, Key]:
    out: dict[str, Key] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        value = getattr(default, name) if isinstance(default, model) else _field_default(info)
        sections = _sections(info.annotation)
        if len(sections) == 1:
            out.update(_keys_of(sections[0], value, f"{path}."))
        elif sections:
            out.update(_several_kinds(sections, value, f"{path}."))
        else:
            kind, choices, nullable = _read_as(info.annotation)
            shown = _shown(info.annotation, value)
            out[path] = Key(path, kind, info.description or "", shown, choices, nullable)
    return out


def _several_kinds(sections: list[type[BaseModel]], default: Any, prefix: str) -> dict[str, Key]:
    """The keys of a section of several kinds: every kind's, each key once, ``within`` the kinds
    that have it; read as YAML where the kinds read it differently."""
    found: dict[str, list[tuple[str, Key]]] = {}
    for section in sections:
        kind = _kind_of(section) or section.__name__
        for path, key in _keys_of(section, default, prefix).items():
            found.setdefault(path, []).append((kind, key))
    out: dict[str, Key] = {}
    for path, entries in found.items():
        kinds = [k for k, _ in entries]
        keys = [key for _, key in entries]
        first = keys[0]
        if path == f"{prefix}type":
            choices = tuple(c for key in keys for c in key.choices)
            out[path] = Key(path, "string", first.description, first.default, choices)
            continue
        same = all((k.kind, k.choices, k.nullable) == (first.kind, first.choices, first.nullable) for k in keys)
        defaults = {k.default for k in keys}
        default = first.default if len(defaults) == 1 else "; ".join(f"{n}: {k.default}" for n, k in entries)
        docs = {k.description for k in keys}
        doc = first.description if len(docs) == 1 else "; ".join(f"{n}: {k.description}" for n, k in entries)
        out[path] = Key(
            path,
            first.kind if same else "yaml",
            doc,
            default,
            first.choices if same else (),
            first.nullable if same else False,
            () if len(entries) == len(sections) else tuple(kinds),
        )
    return out


@cache
def config_keys() -> tuple[Key, ...]:
    """Every key of :class:`~extproc.config.model.Config`, in the model's order."""
    keys = tuple(_keys_of(Config, Config()).values())
    for attribute in ("env", "flag"):
        names = [getattr(k, attribute) for k in keys]
        clashes = {n for n in names if names.count(n) > 1}
        if clashes:  # two paths the rule names alike: a field must be renamed
            raise AssertionError(f"keys named alike by the {attribute} rule: {sorted(clashes)}")
    return keys


def key(path: str) -> Key:
    """The key at ``path`` (KeyError if the model has none)."""
    for candidate in config_keys():
        if candidate.path == path:
            return candidate
    raise KeyError(path)
