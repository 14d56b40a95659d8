"""The Messages and Responses APIs read as the chat request vLLM 0.32 makes of them, checked against
vLLM's own conversion code (run in the engines' venv), and their conversation identities."""

from __future__ import annotations

import contextlib
import json
import subprocess
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.agent_apis import (
    AgentApiError,
    answer_messages,
    messages_as_chat,
    responses_as_chat,
)
from extproc.request.features import FeatureSettings, read_request, with_chain, with_response_id
from extproc.request.openai_body import BodyError, parse_request_body
from tests.conftest import require_engines

TOOLS = [
    {"name": "grep", "description": "search files", "input_schema": {"type": "object", "properties": {}}},
    {"name": "edit", "input_schema": {"type": "object"}, "strict": True},
]

MESSAGES_BODIES: list[dict[str, Any]] = [
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "m",
        "max_tokens": 4,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; hash=abc"},
            {"type": "text", "text": "You are a coding agent."},
            {"type": "text", "text": " Be brief."},
        ],
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "find the bug"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "grep first", "signature": "s"},
                    {"type": "text", "text": "Searching."},
                    {"type": "tool_use", "id": "toolu_1", "name": "grep", "input": {"q": "bug"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.py:3"}]},
                    {"type": "text", "text": "go on"},
                ],
            },
            {"role": "system", "content": "reminder: tests must pass"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "edit", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "done"}]},
        ],
    },
    {
        "model": "m",
        "max_tokens": 4,
        "system": "plain system",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "odd"}]},
            {"role": "user", "content": []},
        ],
    },
]

RESPONSES_BODIES: list[dict[str, Any]] = [
    {"model": "m", "input": "tell me a story"},
    {"model": "m", "instructions": "be terse", "input": [{"role": "user", "content": "q"}]},
    {
        "model": "m",
        "instructions": "agent",
        "tools": [
            {"type": "function", "name": "ls", "description": "list", "parameters": {"type": "object"}},
            {"type": "function", "name": "cat", "parameters": {"type": "object"}, "strict": True},
        ],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "what is here?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": '{"f": "a"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a b"},
            {"type": "function_call_output", "call_id": "c2", "output": "text"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Two files.", "annotations": []}],
            },
            {"role": "user", "content": "thanks"},
        ],
    },
]

# What vLLM 0.32 itself makes of each body: its classes, run in the engines' venv.
_VLLM_SIDE = r"""
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

def plain(x):
    if hasattr(x, "model_dump"):
        return x.model_dump(mode="json")
    raise TypeError(type(x))

cases = json.load(sys.stdin)
out = []
for case in cases:
    if case["api"] == "messages":
        req = AnthropicServingMessages.to_chat_completion_request(
            AnthropicMessagesRequest.model_validate(case["body"]), merge_inline_system=case["merge"])
        tools = [t.model_dump() for t in req.tools] if req.tools is not None else None
        out.append({"messages": req.messages, "tools": tools})
    else:
        req = ResponsesRequest.model_validate(case["body"])
        msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
        out.append({"messages": msgs, "tools": construct_tool_dicts(req.tools, req.tool_choice)})
print(json.dumps(out, default=plain))
"""


def _vllm_views(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from extproc_lab.engines import install

    require_engines()
    done = subprocess.run(
        [str(install.vllm_python()), "-c", _VLLM_SIDE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _text_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts as the chat template sees them: vLLM parses ``input_text`` as text."""
    out = []
    for message in messages:
        m = dict(message)
        if isinstance(m.get("content"), list):
            m["content"] = [
                {"type": "text", "text": p["text"]} if p.get("type") in ("text", "input_text") else p
                for p in m["content"]
            ]
        out.append(m)
    return out


def test_both_apis_convert_as_vllm_converts_them() -> None:
    cases = [{"api": "messages", "body": b, "merge": merge} for b in MESSAGES_BODIES for merge in (False, True)]
    cases += [{"api": "responses", "body": b} for b in RESPONSES_BODIES]
    theirs = _vllm_views(cases)
    for case, vllm in zip(cases, theirs, strict=True):
        if case["api"] == "messages":
            ours = messages_as_chat(case["body"], merge_inline_system=case["merge"])
        else:
            ours = responses_as_chat(case["body"])
        assert _text_parts(ours.messages) == _text_parts(vllm["messages"]), case
        assert ours.tools == vllm["tools"], case


def test_the_rendered_prompt_keeps_the_system_block_and_tools_first() -> None:
    body = MESSAGES_BODIES[1]
    parsed = parse_request_body("/v1/messages", json.dumps(body).encode())
    assert parsed.max_output_tokens == 4 and parsed.chat is not None
    assert parsed.prompt.startswith("<|tools|>")
    assert "You are a coding agent. Be brief." in parsed.prompt and "billing" not in parsed.prompt
    # A next turn shares every block of the turn before (a growing agent context).
    longer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"}]}
    more = parse_request_body("/v1/messages", json.dumps(longer).encode())
    assert more.prompt.startswith(parsed.prompt)


def test_bodies_of_the_wrong_shape_are_body_errors() -> None:
    for path, body in (
        ("/v1/messages", {"model": "m", "max_tokens": 1}),
        ("/v1/messages", {"model": "m", "messages": ["x"]}),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": 3}]}),
        ("/v1/responses", {"model": "m"}),
        ("/v1/responses", {"model": "m", "input": [{"type": "web_search_call"}]}),
    ):
        with pytest.raises(BodyError):
            parse_request_body(path, json.dumps(body).encode())
    with pytest.raises(AgentApiError):
        responses_as_chat({"input": [3]})


SETTINGS = FeatureSettings()


def _features(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return read_request({":path": path, **(headers or {})}, json.dumps(body).encode(), SETTINGS)


def test_responses_session_identity() -> None:
    # ``conversation`` is a session of its own.
    conv = _features("/v1/responses", {"model": "m", "input": "x", "conversation": {"id": "conv_1"}})
    assert conv.features.session_key == "conversation:conv_1"
    # A first turn the router names; the next turn, naming it, continues it (same link), whatever
    # it says otherwise.
    named = with_response_id(_features("/v1/responses", {"model": "m", "input": "x"}), "resp_a", {}, SETTINGS)
    first = with_chain(named, SETTINGS)  # as the router reads it: named, then its chain
    assert first.features.response_id == "resp_a" and first.body is not None
    assert first.body.body["request_id"] == "resp_a"
    chain = first.features.conversation
    assert chain is not None and chain.turn is None and chain.also is not None
    follow = _features("/v1/responses", {"model": "m", "input": "y", "previous_response_id": "resp_a"})
    assert follow.features.conversation is not None and follow.features.conversation.turn == chain.also
    # Another tenant naming the same response id is not led to that conversation.
    other = read_request(
        {":path": "/v1/responses", "x-tenant": "b"},
        json.dumps({"model": "m", "input": "y", "previous_response_id": "resp_a"}).encode(),
        FeatureSettings(tenant_header="x-tenant"),
    )
    assert other.features.conversation is not None and other.features.conversation.turn != chain.also
    # Even with keyless conversations off, previous_response_id is followed: the engine's store is its own.
    off = read_request(
        {":path": "/v1/responses"},
        json.dumps({"model": "m", "input": "y", "previous_response_id": "resp_a"}).encode(),
        FeatureSettings(conversations=False),
    )
    assert off.features.conversation is not None


def test_a_messages_conversation_continues_without_a_key() -> None:
    turn1 = {"model": "m", "max_tokens": 4, "system": "s", "messages": [{"role": "user", "content": "q1"}]}
    turn2 = {
        **turn1,
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
            {"role": "user", "content": "q2"},
        ],
    }
    one = _features("/v1/messages", turn1).features.conversation
    two = _features("/v1/messages", turn2).features.conversation
    assert one is not None and two is not None and two.turn == one.end


def test_answers_are_read_as_vllm_stores_them() -> None:
    output = [
        {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "id": "m", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    whole = json.dumps({"id": "resp_1", "output": output, "usage": {"input_tokens": 3}}).encode()
    assert answer_messages(whole) == [{"role": "assistant", "content": "yes"}]
    stream = (
        b'event: response.created\ndata: {"response":{"id":"resp_1","output":[]}}\n\n'
        b"event: response.completed\ndata: " + json.dumps({"response": {"output": output}}).encode() + b"\n\n"
    )
    assert answer_messages(stream) == [{"role": "assistant", "content": "yes"}]
    assert answer_messages(b"event: response.created\ndata: {}\n\n") is None
    assert answer_messages(b"{not json") is None
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "yes"}]
    view = responses_as_chat({"instructions": "t", "input": "more"}, history)
    assert [m["role"] for m in view.messages] == ["system", "user", "assistant", "user"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["model", "messages", "system", "tools", "input", "instructions"]), _json))
def test_any_json_body_is_read_or_refused_as_a_body_error(body: dict[str, Any]) -> None:
    for path in ("/v1/messages", "/v1/responses"):
        with contextlib.suppress(BodyError):
            parse_request_body(path, json.dumps(body).encode())
    answer_messages(json.dumps(body).encode())
