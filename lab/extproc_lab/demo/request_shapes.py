"""The shapes a client's request may take, for the timeout cases: which API, streamed or not, and
with what ``max_tokens``. Each gets its own per-try budget on the gateway
(:class:`~extproc.api.UpstreamTimeouts`, ``docs/timeouts.md``), so a hung replica
is tried with every one of them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from extproc.api import UpstreamTimeouts
from extproc_lab.demo.load import CHAT_PATH, COMPLETIONS_PATH, MODEL

# More than any model's context: the request's own bound is no bound, only the gateway's cap.
HUGE_MAX_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One kind of request: its API (``path``), streamed or not, and its ``max_tokens`` (None: absent)."""

    path: str
    stream: bool
    max_tokens: int | None

    @property
    def name(self) -> str:
        """For tables: ``chat unary, no max_tokens``."""
        api = "chat" if self.path == CHAT_PATH else "completions"
        tokens = "no max_tokens" if self.max_tokens is None else f"max_tokens {self.max_tokens:,}"
        return f"{api} {'stream' if self.stream else 'unary'}, {tokens}"

    def body(self, text: str) -> bytes:
        """The request body asking about ``text`` in this shape."""
        body: dict[str, object] = {"model": MODEL, "stream": self.stream}
        if self.path == CHAT_PATH:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return json.dumps(body).encode()

    def budget_s(self, upstream: UpstreamTimeouts) -> float:
        """How long the gateway gives a try of this shape before another replica is asked: what
        a hung replica costs it (infinite: only the route timeout)."""
        if self.stream:
            return upstream.first_byte_s
        budget = upstream.unary_budget_s(self.max_tokens)
        return math.inf if budget is None else budget


REQUEST_SHAPES = tuple(
    RequestShape(path, stream, max_tokens)
    for path in (CHAT_PATH, COMPLETIONS_PATH)
    for stream in (False, True)
    for max_tokens in (None, 2, HUGE_MAX_TOKENS)
)
