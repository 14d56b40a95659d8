"""Validation errors as one line per field, each naming the field's full path (the config file's
schema and plugin parameters report the same way)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

# The members of a union add their type names to an error's location: noise to a user.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# Errors whose message says what was wrong without the value (or has none to show).
_MESSAGE_NAMES_VALUE = {"extra_forbidden", "missing", "value_error", "check", "union_tag_invalid"}


def error_path(loc: tuple[int | str, ...]) -> str:
    """``("replicas", 0, "address")`` -> ``replicas[0].address``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(
    exc: Any, *, prefix: str = "", unknown: str = "unknown key", suffix: str = "", tags: Collection[str] = ()
) -> str:
    """A pydantic ``ValidationError`` as ``path: message, got value`` lines joined by ``; ``,
    each path under ``prefix``; an extra field reads ``unknown``. ``tags`` are the values of
    discriminated unions' tags, which pydantic puts into an error's location (``discovery.dns.port``)."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        # A tag sits between its union's field and the member's (an unknown key may be named like one).
        loc = tuple(p for i, p in enumerate(loc) if not (p in tags and 0 < i < len(loc) - 1))
        if err["type"] != "extra_forbidden":
            loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = (*loc, err["ctx"]["discriminator"].strip("'"))
        message = unknown if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        got = (
            ""
            if err["type"] in ("extra_forbidden", "missing", "value_error", "check", "union_tag_invalid")
            else f", got {err['input']!r}"
        )
        path = ".".join(p for p in (prefix, error_path(loc)) if p)
        # A check of the whole names its fields in its message.
        lines.append(f"{path}: {message}{got}{suffix}" if path or err["type"] != "value_error" else message + suffix)
    return "; ".join(dict.fromkeys(lines))


class Section(BaseModel):
    """A mapping of the config file and the runtime value its subsystem reads: unknown keys are
    errors, types strict (``"16"`` is not a number, ``true`` not an integer), the object immutable.

    Validation happens once, when the config is loaded; reading an attribute afterwards is a plain
    attribute read.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def option(default: Any, doc: str, **checks: Any) -> Any:
    """A field with its default, the one line of doc the example config shows, and its checks."""
    return Field(default, description=doc, **checks)


def field_error(model: type[BaseModel], field: str, message: str, value: Any) -> ValidationError:
    """A check across fields that fails on ``field``: raised in a model validator, the error's
    path is that field's, under wherever the model sits in the file."""
    error = InitErrorDetails(type=PydanticCustomError("check", message), loc=(field,), input=value)
    return ValidationError.from_exception_data(model.__name__, [error])
