"""What an agent framework tells about a request: its priority, its expected answer length, and how
long its KV should outlive it (a tool call's pause before the next turn).

Read where the peers and the APIs already put them, nothing invented:

- priority: vLLM's own ``x-vllm-priority`` header and ``priority`` body field, and Dynamo's
  ``nvext.agent_hints.priority`` (all with vLLM's meaning: lower goes sooner, 0 by default). The
  router takes a positive value as a request that may wait behind its class (its queue priority
  lowered by that much), and never a negative one as more than its class allows: a client's
  priority buys no place its class does not give it. The header and fields pass to the engine
  unchanged: the engine reads them itself (its scheduler orders by them with
  ``--scheduling-policy priority``), with or without the router.
- expected output length: Dynamo's ``nvext.agent_hints.osl`` (tokens): the decode the price
  expects, in place of ``max_tokens`` (a cap, not an estimate) or the configured typical answer.
- KV retention: Anthropic's ``cache_control`` on a Messages request's blocks (``ephemeral``, its
  ``ttl`` ``"5m"`` by default or ``"1h"``) and the ``agent_hint.cache_control.ttl`` (seconds) of
  vLLM's session-aware KV hints: the session's pin and its replica's live-session load are held
  that long after the turn began, while the agent runs its tool (at most ``sessions.ttl_s``).

The agent's identity is its session key (:mod:`extproc.request.session`): Claude Code's
``x-claude-code-session-id`` and OpenCode's ``x-session-affinity`` beside ``x-session-id``, as
llm-d's agent-identity plugin reads them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PRIORITY_HEADER = "x-vllm-priority"
"""vLLM's own request priority header (lower goes sooner)."""

MAX_DEMOTION = 10
"""The most a client's priority lowers its request below its class (a bound on the queue's levels)."""

_TTL_WORDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True, slots=True)
class AgentHints:
    """The hints one request carries (None: not given)."""

    demotion: int = 0
    """How many queue priority levels the request asks to go below its class (never negative)."""
    expected_output_tokens: int | None = None
    kv_retention_s: float | None = None


NO_HINTS = AgentHints()


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip()[:24])
        except ValueError:
            return None
    return None


def _ttl(control: Any) -> float | None:
    """A ``cache_control`` object's time to live in seconds (Anthropic's ``ephemeral``: 5 minutes
    unless its ``ttl`` says ``"1h"``; vLLM's hint: seconds)."""
    if not isinstance(control, Mapping) or control.get("type", "ephemeral") != "ephemeral":
        return None
    ttl = control.get("ttl", "5m")
    if isinstance(ttl, str):
        return _TTL_WORDS.get(ttl)
    if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl < math.inf:
        return float(ttl)
    return None


def _longest_cache_control(body: Mapping[str, Any]) -> float | None:
    """The longest ``cache_control`` ttl of a Messages body's system blocks, tools and content blocks."""
    found: list[float] = []
    blocks: list[Any] = []
    for key in ("system", "tools"):
        if isinstance(body.get(key), list):
            blocks.extend(body[key])
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, Mapping) and isinstance(m.get("content"), list):
                blocks.extend(m["content"])
    for block in blocks:
        if isinstance(block, Mapping) and (ttl := _ttl(block.get("cache_control"))) is not None:
            found.append(ttl)
    return max(found) if found else None


def read_hints(headers: Mapping[str, str], body: Mapping[str, Any] | None) -> AgentHints:
    """The hints of a request's headers and parsed body; anything malformed is no hint."""
    body = body or {}
    nvext = body.get("nvext")
    dynamo = nvext.get("agent_hints") if isinstance(nvext, Mapping) else None
    dynamo = dynamo if isinstance(dynamo, Mapping) else {}
    priority = _int(headers.get(PRIORITY_HEADER))  # vLLM reads its header before its body field
    if priority is None:
        priority = _int(dynamo.get("priority"))
    if priority is None:
        priority = _int(body.get("priority"))
    demotion = min(MAX_DEMOTION, max(0, priority or 0))
    osl = _int(dynamo.get("osl"))
    expected = osl if osl is not None and osl > 0 else None
    retention = None
    hint = body.get("agent_hint")
    if isinstance(hint, Mapping):
        retention = _ttl(hint.get("cache_control"))
    if retention is None:
        retention = _longest_cache_control(body)
    if demotion == 0 and expected is None and retention is None:
        return NO_HINTS
    return AgentHints(demotion, expected, retention)
