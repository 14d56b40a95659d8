"""Agent hints: read where vLLM, Dynamo and Anthropic's API put them, and what they change: a
client's priority only ever lowers its request's place, an expected length is the decode priced,
a KV retention holds the session live across a tool call."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from extproc.fleet.health.sessions import LiveSessions
from extproc.fleet.queueing import Admission, QueueClass, QueueSettings, Waiter
from extproc.request.agent_hints import MAX_DEMOTION, NO_HINTS, AgentHints, read_hints
from extproc.request.features import FeatureSettings, read_request
from extproc.request.session import SessionSource


def test_hints_are_read_where_the_peers_put_them() -> None:
    assert read_hints({}, {}) is NO_HINTS
    assert read_hints({"x-vllm-priority": "3"}, None).demotion == 3
    # vLLM reads its header before its body field; Dynamo's nvext beside them.
    assert read_hints({"x-vllm-priority": "2"}, {"priority": 7}).demotion == 2
    assert read_hints({}, {"nvext": {"agent_hints": {"priority": 4, "osl": 900}}}) == AgentHints(4, 900, None)
    assert read_hints({}, {"priority": 1}).demotion == 1
    # More urgent than its class, or nonsense: nothing changes; at most MAX_DEMOTION levels down.
    for value in ("-5", "high", "", "1e9"):
        assert read_hints({"x-vllm-priority": value}, None).demotion == 0, value
    assert read_hints({"x-vllm-priority": "999999"}, None).demotion == MAX_DEMOTION
    assert read_hints({}, {"nvext": {"agent_hints": {"osl": 0}}}).expected_output_tokens is None
    # KV retention: Anthropic's cache_control (5 minutes by default, an hour on request), vLLM's hint.
    system = [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]
    assert read_hints({}, {"system": system}).kv_retention_s == 300.0
    tools = [{"name": "t", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert read_hints({}, {"system": system, "tools": tools}).kv_retention_s == 3600.0
    blocks = [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]}]
    assert read_hints({}, {"messages": blocks}).kv_retention_s == 300.0
    assert read_hints({}, {"agent_hint": {"cache_control": {"type": "ephemeral", "ttl": 30}}}).kv_retention_s == 30.0
    assert read_hints({}, {"agent_hint": {"cache_control": {"ttl": -1}}}).kv_retention_s is None


@given(
    st.dictionaries(
        st.text(max_size=6),
        st.recursive(
            st.none() | st.integers() | st.text(max_size=4),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
            max_leaves=12,
        ),
    )
)
def test_any_body_gives_hints_or_none(body: dict[str, Any]) -> None:
    hints = read_hints({"x-vllm-priority": "x"}, {**body, "nvext": body, "agent_hint": body})
    assert 0 <= hints.demotion <= MAX_DEMOTION


def test_an_agents_own_session_header_is_its_session_key() -> None:
    settings = FeatureSettings()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}]}).encode()
    for header in ("x-claude-code-session-id", "x-session-affinity"):
        got = read_request({":path": "/v1/chat/completions", header: "agent-7"}, body, settings).features
        assert got.session_key == "agent-7" and got.conversation is None, header
    assert SessionSource("header", "x-claude-code-session-id") in settings.session_sources


def test_the_expected_length_is_the_decode_priced() -> None:
    settings = FeatureSettings()
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2000}
    plain = read_request({":path": "/v1/chat/completions"}, json.dumps(body).encode(), settings).features
    assert plain.expected_output_tokens == 2000  # the cap, when nothing better is known
    body["nvext"] = {"agent_hints": {"osl": 120}}
    hinted = read_request({":path": "/v1/chat/completions"}, json.dumps(body).encode(), settings).features
    assert hinted.expected_output_tokens == 120
    body["max_tokens"] = 50
    capped = read_request({":path": "/v1/chat/completions"}, json.dumps(body).encode(), settings).features
    assert capped.expected_output_tokens == 50


def test_a_demoted_request_waits_behind_its_class_and_never_ahead() -> None:
    settings = QueueSettings(enabled=True, default=QueueClass(priority=1, max_wait_s=5))
    full = [True]
    core: Admission[str] = Admission(settings, lambda pool: full[0], lambda: 0.0)
    assert isinstance(core.admit("default", "a", (), "background", demotion=2), Waiter)
    assert isinstance(core.admit("default", "a", (), "plain"), Waiter)
    full[0] = False
    assert [w.item for w in iter(core.next_to_go, None)] == ["plain", "background"]


def test_a_retained_session_stays_live_across_its_tool_call() -> None:
    live = LiveSessions(live_s=10.0)
    live.begin("r1", "agent", 0.0, hold_s=45.0)
    live.begin("r1", "chat", 0.0)
    live.end("agent")
    live.end("chat")
    assert live.counts(5.0) == {"r1": 2}
    assert live.counts(20.0) == {"r1": 1}  # the chat is over; the agent's tool call is not
    assert live.counts(44.0) == {"r1": 1}
    assert live.counts(46.0) == {}
