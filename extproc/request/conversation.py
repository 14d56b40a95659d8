"""Conversation identity from a chat request's own messages, for requests without a session key.

A chat client resends the whole conversation each turn: the messages of its last request, the
answer it got, and a new user message. So the messages of a continuing conversation *before its
last assistant turn* are exactly the messages of the request that produced that answer. Each
message is hashed into a chain (message ``i``'s hash is seeded with message ``i - 1``'s, the
first with the model and the tools), and a request is known by two links of it:

- ``turn``: the chain up to (not including) the last assistant message; None when the request has
  no assistant message. The router looks it up among the chains of recent requests: found, the
  request continues that request's conversation.
- ``end``: the chain of every message, what the conversation's next request's ``turn`` will be.
  The router remembers it, mapped to the conversation, after routing the request.

A request with no assistant message opens a new conversation, and so does one whose ``turn``
matches no recent request (few-shot examples written as assistant turns, or a conversation the
router has forgotten): it gets an identity of its own, drawn, not made from its messages, so a
burst of identical first turns is that many conversations. Two conversations that share only a
system prompt differ from their first user message on, so their next turns find their own. Two
that open with exactly the same messages cannot be told apart at their second turn (the router
never sees an answer before the client resends it): both find the identity the chain was last
remembered with, whose replica holds the same first turn.

Pure: no I/O, no clock. The lookups and the memory are :mod:`extproc.state.conversations`'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from extproc.request.openai_body import content_text

_xxh3 = xxhash.xxh3_64_intdigest

Match = Literal["new", "continued", "unmatched"]
"""How a keyless request's conversation was found: it opens one (no assistant turn), it continues
a recent request's, or it has assistant turns that continue no request the router remembers."""

KEY_PREFIX = "conv-"
"""Session keys made from a conversation's identity read ``conv-`` and 16 hex digits."""


@dataclass(frozen=True, slots=True)
class ConversationChain:
    """The links of a chat request's message chain that identify its conversation."""

    end: int
    """The chain over every message."""
    turn: int | None
    """The chain over the messages before the last assistant message; None without one."""
    messages: int
    """How many messages the chain covers."""
    turn_messages: int = 0
    """How many messages ``turn`` covers."""
    conversation: int | None = None
    """The conversation's identity once resolved (:mod:`extproc.state.conversations`)."""
    match: Match | None = None
    """How it was resolved; None until then."""
    stored: bool = False
    """The engine keeps this conversation in its own memory (a Responses API turn naming
    ``previous_response_id``): once continued, the turn goes to its pinned replica or fails there."""
    also: int | None = None
    """A second link remembered with ``end``: the id of the response a Responses API request makes
    (:func:`response_link`), for a later request naming it as ``previous_response_id`` to find."""

    @property
    def session_key(self) -> str | None:
        """The session key the conversation is routed under, once resolved."""
        return conversation_key(self.conversation) if self.conversation is not None else None


def conversation_key(conversation: int) -> str:
    """The session key of a conversation identity."""
    return f"{KEY_PREFIX}{conversation:016x}"


def _message_bytes(message: Any) -> bytes:
    """A message as the chain hashes it: its role, its content's text (media by reference, as the
    prefix hashes read it), its tool calls, and whom a tool answer is for."""
    if not isinstance(message, dict):
        return b"\x00"
    role = message.get("role")
    text, _ = content_text(message.get("content"))
    parts = [role if isinstance(role, str) else "", text]
    for extra in ("tool_calls", "tool_call_id", "name"):
        value = message.get(extra)
        if value is not None:
            parts.append(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str))
    return "\x1f".join(parts).encode("utf-8", "surrogatepass")


def conversation_chain(messages: Sequence[Any], tools: Any, seed: int) -> ConversationChain | None:
    """The chain of ``messages`` (seeded with ``seed``, the model's, and the tools); None for a
    request without messages."""
    if not messages:
        return None
    h = seed
    if tools:
        h = _xxh3(json.dumps(tools, sort_keys=True, separators=(",", ":"), default=str).encode(), h)
    turn: int | None = None
    turn_messages = 0
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            turn, turn_messages = h, i  # the chain as it stood before this assistant message
        h = _xxh3(_message_bytes(message), h)
    return ConversationChain(end=h, turn=turn, messages=len(messages), turn_messages=turn_messages)


def response_link(response_id: str, tenant: str, seed: int) -> int:
    """The link a Responses API response id is remembered under (its tenant's: a response id
    never leads one tenant to another's conversation)."""
    return _xxh3(f"resp\x1f{tenant}\x1f{response_id}".encode("utf-8", "surrogatepass"), seed)


def response_chain(previous: str, response_id: str | None, tenant: str, seed: int, messages: int) -> ConversationChain:
    """A Responses API request that continues ``previous`` (its ``previous_response_id``): found
    by that response's link, remembered by its own response's (the previous one's again when its
    id is not known). The engine keeps the stored conversation in its own memory, so the turn must
    go where the previous response was made."""
    turn = response_link(previous, tenant, seed)
    end = response_link(response_id, tenant, seed) if response_id else turn
    return ConversationChain(end=end, turn=turn, messages=messages, turn_messages=messages, stored=True)
