"""Session keys: which conversation a request belongs to, from configurable sources in priority order.

A source is written ``header:NAME``, ``cookie:NAME`` or ``body:a.b.c`` (a dotted path into the
JSON body, e.g. ``body:user`` or ``body:metadata.session_id``). The first source that yields a
non-empty string wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SourceKind = Literal["header", "cookie", "body"]
MAX_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class SessionSource:
    """One place a session key may be read from."""

    kind: SourceKind
    name: str

    @classmethod
    def parse(cls, spec: str) -> SessionSource:
        """Parse ``kind:name``; raises ValueError naming what is wrong."""
        kind, sep, name = spec.partition(":")
        if not sep or not name or kind not in ("header", "cookie", "body"):
            raise ValueError(f"session source {spec!r}: expected header:NAME, cookie:NAME or body:PATH")
        return cls(kind, name.lower() if kind == "header" else name)  # type: ignore[arg-type]


def cookie_value(cookie_header: str, name: str) -> str | None:
    """Value of cookie ``name`` in a Cookie header, or None."""
    for item in cookie_header.split(";"):
        key, sep, value = item.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"') or None
    return None


def _body_value(body: Mapping[str, Any] | None, path: str) -> str | None:
    node: Any = body
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    if isinstance(node, str) and node:
        return node
    if isinstance(node, int) and not isinstance(node, bool):
        return str(node)
    return None


def session_key(
    sources: Sequence[SessionSource],
    headers: Mapping[str, str],
    body: Mapping[str, Any] | None,
) -> str | None:
    """The first non-empty session key found, truncated to a sane length, or None."""
    for source in sources:
        value: str | None
        if source.kind == "header":
            value = headers.get(source.name) or None
        elif source.kind == "cookie":
            cookies = headers.get("cookie")
            value = cookie_value(cookies, source.name) if cookies else None
        else:
            value = _body_value(body, source.name)
        if value:
            return value[:MAX_KEY_CHARS]
    return None
