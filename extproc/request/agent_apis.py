"""The Responses API and Anthropic's Messages API as the chat request vLLM (0.32) turns them into.

vLLM serves neither with a prompt of its own: ``/v1/messages`` is converted to a chat completion
request (its ``AnthropicServingMessages.to_chat_completion_request``) and ``/v1/responses`` is
rendered through the chat template from the messages its ``construct_input_messages`` builds. So
the router reads both as the chat messages and tools the engine's template will see, and hashes
and tokenizes those: the prefix hashes of a Messages or Responses request are in the engine's own
key space wherever a chat request's are.

What each API contributes, as vLLM 0.32 converts it:

- Messages: the top-level ``system`` (a string, or text blocks joined with nothing between, Claude
  Code's ``x-anthropic-billing-header`` block left out) is one leading system message; text blocks
  are text parts (one alone is the content string), ``image`` blocks image URLs, ``thinking``
  blocks the message's ``reasoning``, ``tool_use`` blocks ``tool_calls`` (their input as JSON), a
  user's ``tool_result`` blocks ``tool`` messages placed before the user message that carried them;
  tools are functions (name, description, ``input_schema`` as parameters). Where the engine's chat
  template takes only a leading system message, inline system messages are merged into it
  (``merge_inline_system``, which the tokenizer detects as vLLM does).
- Responses: ``instructions`` is the system message, a string ``input`` one user message, a list
  of items messages (function calls join the assistant message before them, function call outputs
  are ``tool`` messages, reasoning is ``reasoning``); function tools are chat tools. With
  ``previous_response_id`` the engine prepends the stored conversation, which the body does not
  carry: the router pins such a request to where its previous response was made (the engine's
  store is its own) and predicts its cache from what that replica holds for the stored prefix.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"

_BILLING = "x-anthropic-billing-header"
"""Claude Code's per-request system block, which vLLM drops (its hash defeats prefix caching)."""


class AgentApiError(ValueError):
    """A body that is not of its API's shape."""


@dataclass(frozen=True, slots=True)
class ChatView:
    """A request of another API as the chat request the engine renders."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def _function_tool(name: Any, description: Any, parameters: Any, strict: Any = None) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it to the template (field
    order kept: a template that renders tools as JSON renders them in this order)."""
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


# -- Anthropic's Messages API ---------------------------------------------------------------------


def _system_text(content: Any) -> str | None:
    """A system message's or ``system`` field's text, billing blocks left out; None if empty."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    if not isinstance(content, list):
        return None
    parts = [
        b["text"]
        for b in content
        if isinstance(b, Mapping)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(_BILLING)
    ]
    return "".join(parts) if parts else None


def _image_url(source: Any) -> str:
    if not isinstance(source, Mapping):
        return ""
    if source.get("type") == "url":
        url = source.get("url", "")
        return url if isinstance(url, str) else ""
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's ``tool_result`` block as the ``tool`` message (and image message) vLLM adds."""
    content = block.get("content")
    text, images = "", []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})


def _anthropic_message(message: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    role = message.get("role")
    if not isinstance(role, str):
        raise AgentApiError("a message without a role")
    converted: dict[str, Any] = {"role": role}
    content = message.get("content")
    if isinstance(content, str):
        converted["content"] = content
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            if not isinstance(block, Mapping):
                raise AgentApiError("a content block is not an object")
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                # vLLM names an id-less call by the clock; a client resends the id it was given.
                calls.append(
                    {
                        "id": block.get("id") or "call_0",
                        "type": "function",
                        "function": {
                            "name": block.get("name") or "",
                            "arguments": json.dumps(block.get("input") or {}),
                        },
                    }
                )
            elif kind == "tool_result":
                if role == "user":
                    _tool_result(block, out)
                else:
                    result = block.get("content")
                    parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
        if reasoning:
            converted["reasoning"] = "".join(reasoning)
        if calls:
            converted["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            converted["content"] = parts[0]["text"]
        elif parts:
            converted["content"] = parts
    elif content is not None:
        raise AgentApiError("message content is neither a string nor blocks")
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def messages_as_chat(body: Mapping[str, Any], *, merge_inline_system: bool = False) -> ChatView:
    """A ``/v1/messages`` body as vLLM's chat request (``merge_inline_system``: the engine's
    template takes only a leading system message, so inline ones join it)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise AgentApiError("messages request without a messages list")
    system: list[str] = []
    top = _system_text(body.get("system"))
    if top:
        system.append(top)
    if merge_inline_system:
        for m in messages:
            if isinstance(m, Mapping) and m.get("role") == "system" and (text := _system_text(m.get("content"))):
                system.append(text)
    out: list[dict[str, Any]] = [{"role": "system", "content": "".join(system)}] if system else []
    for m in messages:
        if not isinstance(m, Mapping):
            raise AgentApiError("a message is not an object")
        if m.get("role") == "system":
            if not merge_inline_system and (text := _system_text(m.get("content"))):
                out.append({"role": "system", "content": text})
            continue
        _anthropic_message(m, out)
    tools = body.get("tools")
    chat_tools = None
    if isinstance(tools, list):
        chat_tools = [
            _function_tool(t.get("name"), t.get("description"), t.get("input_schema"), t.get("strict"))
            for t in tools
            if isinstance(t, Mapping)
        ]
    return ChatView(out, chat_tools)


# -- the Responses API ----------------------------------------------------------------------------


def _input_content(content: Any) -> Any:
    """An input message's content with the Responses API's part types as chat's (``input_text``
    and ``output_text`` are text to vLLM's content parser)."""
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in ("input_text", "output_text"):
            out.append({"type": "text", "text": part.get("text", "")})
        elif isinstance(part, Mapping) and part.get("type") == "input_image":
            out.append({"type": "image_url", "image_url": {"url": part.get("image_url") or part.get("file_id") or ""}})
        else:
            out.append(part)
    return out


def _response_item(item: Any, out: list[dict[str, Any]]) -> None:
    """One input item, appended or merged into the assistant message before it, as vLLM does."""
    if not isinstance(item, Mapping):
        raise AgentApiError("an input item is not an object")
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input") or ""})
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": arguments},
            "type": "function",
        }
        if prev is not None and isinstance(prev.get("tool_calls", []), list):
            prev.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
        return
    if kind == "reasoning":
        content, summary = item.get("content"), item.get("summary")
        text = ""
        if isinstance(content, list) and content and isinstance(content[0], Mapping):
            text = str(content[0].get("text", ""))
        elif isinstance(summary, list) and summary and isinstance(summary[0], Mapping):
            text = str(summary[0].get("text", ""))
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            out.append({"role": "assistant", "reasoning": text})
        return
    if kind in ("function_call_output", "custom_tool_call_output"):
        out.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        return
    role = item.get("role")
    if role == "assistant":
        content = item.get("content")
        said: Any = content if isinstance(content, str) else None
        if isinstance(content, list) and content and isinstance(content[0], Mapping):
            said = content[0].get("text")
        if isinstance(said, str):
            if prev is not None and prev.get("content") is None:
                prev["content"] = said
            else:
                out.append({"role": "assistant", "content": said})
            return
    if isinstance(role, str):
        message = {k: v for k, v in item.items() if k != "type"}
        message["content"] = _input_content(item.get("content"))
        out.append(message)
        return
    raise AgentApiError(f"an input item of type {kind!r}")


def responses_as_chat(body: Mapping[str, Any], history: Sequence[Mapping[str, Any]] = ()) -> ChatView:
    """A ``/v1/responses`` body as vLLM's chat request. ``history``: the stored conversation a
    ``previous_response_id`` names (its messages and the previous answer), where known."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    out.extend(dict(m) for m in history if m.get("role") != "system")  # instructions do not carry over
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _response_item(item, out)
    else:
        raise AgentApiError("responses request without an input")
    tools = body.get("tools")
    chat_tools = None
    if isinstance(tools, list) and tools:
        chat_tools = [
            _function_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict"))
            for t in tools
            if isinstance(t, Mapping) and t.get("type") == "function"
        ] or None
    return ChatView(out, chat_tools)


def conversation_id(body: Mapping[str, Any]) -> str | None:
    """The Responses API's ``conversation`` (an id, or an object with one)."""
    value = body.get("conversation")
    if isinstance(value, Mapping):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


def previous_response_id(body: Mapping[str, Any]) -> str | None:
    """The response a Responses request continues."""
    value = body.get("previous_response_id")
    return value if isinstance(value, str) and value else None


def max_output_tokens(path: str, body: Mapping[str, Any]) -> int | None:
    """The output cap each API names: the Responses API's ``max_output_tokens``, Messages' (required)
    ``max_tokens``."""
    value = body.get("max_output_tokens" if path == RESPONSES_PATH else "max_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


# -- what the engine stores of a response ---------------------------------------------------------

TRANSCRIPT_BYTES = 1 << 20
"""The most of a Responses answer read for its output, and of a conversation shared through Redis
(compressed): past it, the next turn is routed by its pin and predicted without the conversation."""


def answer_messages(body: bytes) -> list[dict[str, Any]] | None:
    """The assistant messages vLLM's store adds to a conversation from a Responses answer: each
    text of each output message (reasoning and function calls are not carried over), read from a
    JSON body or from a stream's ``response.completed`` event; None when it holds no response."""
    response: Any = None
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        try:
            response = json.loads(text)
        except ValueError:
            return None
    else:
        at = text.rfind("event: response.completed")
        data = text.find("data:", at) if at >= 0 else -1
        start = text.find("{", data) if data >= 0 else -1
        if start < 0:
            return None
        try:
            response = json.JSONDecoder().raw_decode(text, start)[0]
        except ValueError:
            return None
        response = response.get("response") if isinstance(response, Mapping) else None
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return None
    out: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, Mapping) and item.get("type") == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    out.append({"role": "assistant", "content": part["text"]})
    return out
