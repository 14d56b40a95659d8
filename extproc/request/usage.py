"""The token usage a response reports, read as its body passes: nothing the client sees changes.

OpenAI-compatible servers report a request's tokens in ``usage`` (``prompt_tokens``,
``completion_tokens``, and vLLM's ``prompt_tokens_details.cached_tokens``): at the end of a JSON
body, and, for a stream, in a last chunk with no choices that the server sends only when the
request asked ``stream_options.include_usage``. So that every stream reports, the router asks for
it (:func:`ask_for_usage`) and, for a client that did not ask, takes that chunk out again
(:class:`UsageStripper`); the client's bytes are otherwise the replica's, in the replica's order.

Only a bounded tail of a body is kept (:data:`TAIL_BYTES`): a stream is never held. Its events
are counted as they pass (:attr:`UsageTail.events`): a stream cut short before its usage chunk
is charged the output it was seen to carry.

Other APIs name their tokens differently (the Responses and Anthropic APIs ``input_tokens`` and
``output_tokens``, embeddings and rerank ``total_tokens``): :func:`parse_usage` reads them all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TAIL_BYTES = 4096
"""The usage object is a few hundred bytes: the last 4 KB of a body hold it whatever the chunking."""

_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens one response reported (``input`` includes the ``cached_input`` ones; None: the
    server reported no cached tokens, e.g. vLLM without ``--enable-prompt-tokens-details``)."""

    input: int = 0
    cached_input: int | None = 0
    output: int = 0
    estimated: bool = False
    """Estimated by the router (a stream cut short, a body not parsed, an answer without usage),
    not reported by the replica."""

    @property
    def total(self) -> int:
        """Input and output tokens."""
        return self.input + self.output


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


_TOKEN_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "prompt_tokens_details",
    "input_tokens_details",
)


def parse_usage(obj: Mapping[str, Any]) -> Usage:
    """A ``usage`` object as :class:`Usage` (what is missing or malformed counts 0): OpenAI's
    ``prompt_tokens``/``completion_tokens``, the Responses and Anthropic APIs'
    ``input_tokens``/``output_tokens``, or a ``total_tokens`` alone (embeddings, rerank: input)."""
    details = obj.get("prompt_tokens_details") or obj.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) and "cached_tokens" in details else None
    if cached is None and ("cache_read_input_tokens" in obj or "cache_creation_input_tokens" in obj):
        # Anthropic's: the prompt is input_tokens + cache_read + cache_creation (vLLM's
        # /v1/messages reports a prompt's newly cached blocks as cache_creation_input_tokens).
        cached = _int(obj.get("cache_read_input_tokens"))
        prompt = _int(obj.get("input_tokens")) + cached + _int(obj.get("cache_creation_input_tokens"))
        return Usage(prompt, cached, _int(obj.get("output_tokens")))
    output = _int(obj.get("completion_tokens", obj.get("output_tokens")))
    if "prompt_tokens" in obj or "input_tokens" in obj:
        prompt = _int(obj.get("prompt_tokens", obj.get("input_tokens")))
    else:
        prompt = max(0, _int(obj.get("total_tokens")) - output)
    return Usage(prompt, cached, output)


def reports_tokens(obj: Mapping[str, Any]) -> bool:
    """Whether a ``usage`` object counts tokens at all (an audio answer may count seconds)."""
    return any(name in obj for name in _TOKEN_FIELDS)


_EVENT = b"data: {"
_ROLE = b'"role"'
"""A chat stream's role-only opening chunk (a model's text cannot hold ``"role"`` unescaped)."""


def _count(mark: bytes, before: bytes, chunk: bytes) -> int:
    """``mark`` in ``chunk``, and once where it straddles ``before``'s end and ``chunk``'s start."""
    seam = before[-(len(mark) - 1) :] + chunk[: len(mark) - 1]
    return chunk.count(mark) + seam.count(mark)


class UsageTail:
    """The last :data:`TAIL_BYTES` of a response body, the usage they report, and the events of
    a server-sent-events stream seen so far."""

    __slots__ = ("_tail", "events", "roles")

    def __init__(self) -> None:
        self._tail = b""
        self.events = 0
        """``data: {...}`` events seen: one output token each in vLLM's chat streams (one chunk an
        engine step, the finish reason riding the last token's), and the role-only opening chunk."""
        self.roles = 0
        """Of those, role-only opening chunks (vLLM's chat writes one with its first output)."""

    def feed(self, chunk: bytes) -> None:
        """One more piece of the body."""
        # An event's start cut by the piece's end is counted once its rest arrives.
        self.events += _count(_EVENT, self._tail, chunk)
        if self.events:  # a JSON answer's message names its role too: not an event
            self.roles += _count(_ROLE, self._tail, chunk)
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]

    @property
    def output_seen(self) -> int:
        """The output tokens the events seen carried: the events less the role-only chunk, which
        carries none (counted as a token, a stream abandoned right after it was charged one
        more than vLLM generated)."""
        return max(0, self.events - self.roles)

    def usage(self) -> Usage | None:
        """The last ``usage`` object the body reported; None if none can be read."""
        text = self._tail.decode("utf-8", "replace")
        decoder = json.JSONDecoder()
        at = len(text)
        while (at := text.rfind('"usage"', 0, at)) >= 0:
            start = text.find("{", at + len('"usage"'))
            if start < 0:
                continue
            try:
                obj, _ = decoder.raw_decode(text, start)
            except ValueError:
                continue
            if isinstance(obj, dict) and reports_tokens(obj):
                return parse_usage(obj)
        return None

    def cached_tokens(self) -> int | None:
        """The cached prompt tokens the body reported; None if it reported none."""
        usage = self.usage()
        return usage.cached_input if usage is not None else None


def ask_for_usage(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A streamed request's body with ``stream_options.include_usage`` set, when the client did
    not set it (None: nothing to change: not a stream, or it asked already)."""
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    merged = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    return {**body, "stream_options": merged}


class UsageStripper:
    """Takes the usage-only chunk out of a server-sent-events stream, for a client that did not
    ask for it, and keeps its usage.

    Events are split on their blank-line terminator; an event cut by a body chunk's end is held
    until its end arrives (a few bytes, as servers write one event at a time), so the client gets
    every other byte, in order.
    """

    __slots__ = ("_partial", "usage")

    def __init__(self) -> None:
        self._partial = b""
        self.usage: Usage | None = None

    def feed(self, chunk: bytes, end: bool = False) -> bytes:
        """The bytes of ``chunk`` to pass on (``end``: the body's last chunk: nothing is held)."""
        data = self._partial + chunk
        cut = data.rfind(b"\n\n")
        if end or not data:
            complete, self._partial = data, b""
        elif cut < 0:
            complete, self._partial = b"", data
        else:
            complete, self._partial = data[: cut + 2], data[cut + 2 :]
        if b'"usage"' not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n"):
            if self._is_usage_only(event):
                continue
            kept.append(event)
        return b"\n\n".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        line = event.strip()
        # Streams that ask for usage carry ``"usage": null`` in every chunk: only one without
        # choices is parsed.
        if not line.startswith(b"data:") or b'"usage"' not in line or not _NO_CHOICES.search(line):
            return False
        try:
            obj = json.loads(line[len(b"data:") :])
        except ValueError:
            return False
        if not isinstance(obj, dict) or obj.get("choices") or not isinstance(obj.get("usage"), dict):
            return False
        self.usage = parse_usage(obj["usage"])
        return True
