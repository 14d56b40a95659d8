"""Validation errors as one line per field, each naming the field's full path (the config file's
schema and plugin parameters report the same way)."""

from __future__ import annotations

from typing import Any

# The members of a union add their type names to an error's location: noise to a user.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_path(loc: tuple[int | str, ...]) -> str:
    """``("replicas", 0, "address")`` -> ``replicas[0].address``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(exc: Any, *, prefix: str = "", unknown: str = "unknown key", suffix: str = "") -> str:
    """A pydantic ``ValidationError`` as ``path: message, got value`` lines joined by ``; ``,
    each path under ``prefix``; an extra field reads ``unknown``."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        if err["type"] != "extra_forbidden":
            loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
        message = unknown if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] in ("extra_forbidden", "missing") else f", got {err['input']!r}"
        path = ".".join(p for p in (prefix, error_path(loc)) if p) or "config"
        lines.append(f"{path}: {message}{got}{suffix}")
    return "; ".join(dict.fromkeys(lines))
