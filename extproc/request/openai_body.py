"""Reading OpenAI-compatible request bodies: model, prompt text, stream flag, user.

The prompt is rendered the way a chat template would lay it out (tools first, then the
messages in order), so that two requests whose conversations share a beginning also share
the beginning of the rendered text, and therefore their first prefix blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.request.agent_apis import (
    MESSAGES_PATH,
    RESPONSES_PATH,
    AgentApiError,
    ChatView,
    messages_as_chat,
    responses_as_chat,
)
from extproc.request.agent_apis import max_output_tokens as agent_max_output_tokens

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
AGENT_PATHS = frozenset({MESSAGES_PATH, RESPONSES_PATH})
"""Anthropic's Messages API and the Responses API: read as the chat request vLLM turns them into
(:mod:`extproc.request.agent_apis`)."""
INFERENCE_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH}) | AGENT_PATHS
"""The paths whose bodies the router reads: their prompt, model and session."""
USAGE_ASKED_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})
"""The paths whose streams report usage only when asked (``stream_options.include_usage``): the
Messages and Responses APIs' streams always report it (in ``message_delta`` and
``response.completed``), and their bodies take no ``stream_options``."""
OTHER_TOKEN_PATHS = frozenset(
    {
        "/v1/chat/completions/batch",
        "/cohere/v2/chat",
        "/inference/v1/generate",
        "/generative_scoring",
        "/invocations",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
"""Paths vLLM (0.32) serves that run the model, beyond chat and completions: with ``budgets:`` they
are metered (their body is not parsed: admitted on an estimate from its size, charged what the
response reports, else that estimate) or refused (``budgets.other_paths``). Tokenizing,
rendering and counting tokens cost no engine step and are not among them."""


def costs_tokens(path: str) -> bool:
    """Whether a request to ``path`` runs the model (chat, completions, or another such path)."""
    return path in INFERENCE_PATHS or path in OTHER_TOKEN_PATHS or path.startswith("/v1/audio/")


class BodyError(ValueError):
    """The body is not a JSON object of the OpenAI shape; routing falls back to what headers tell."""


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """What routing needs from an OpenAI request body."""

    model: str
    prompt: str
    stream: bool
    user: str | None
    body: dict[str, Any]
    has_media: bool = False
    max_output_tokens: int | None = None
    chat: ChatView | None = None
    """For the Messages and Responses APIs: the chat request the engine renders from the body."""


def max_output_tokens(body: dict[str, Any]) -> int | None:
    """``max_completion_tokens`` (the chat API's newer name) or ``max_tokens``; None when neither is
    a non-negative integer (the server then generates up to the model's context)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


_NOT_FOR_ONE_TOKEN = (
    "stream",
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
    "n",
    "best_of",
)


def one_token(request: Mapping[str, Any]) -> dict[str, Any]:
    """The same request asking for its prompt's first token only, unstreamed: what a pre-warm or a
    disaggregated prefill sends (``min_tokens`` and several choices would ask for more)."""
    out = {k: v for k, v in request.items() if k not in _NOT_FOR_ONE_TOKEN}
    out["max_tokens"] = 1
    return out


def _part_text(part: Any) -> tuple[str, bool]:
    """Text of one content part; media parts contribute their URL/data so equal images hash equal."""
    if isinstance(part, str):
        return part, False
    if not isinstance(part, dict):
        return "", False
    kind = part.get("type")
    if kind == "text" or "text" in part:
        text = part.get("text")
        return (text if isinstance(text, str) else ""), False
    for media_key in ("image_url", "input_audio", "audio_url", "video_url"):
        media = part.get(media_key)
        if media is not None:
            ref = media.get("url") or media.get("data") if isinstance(media, dict) else media
            return f"<{media_key}:{ref if isinstance(ref, str) else ''}>", True
    return "", False


def content_text(content: Any) -> tuple[str, bool]:
    """Render message content given as a string or a list of parts; also says whether media was present."""
    if content is None:
        return "", False
    if isinstance(content, str):
        return content, False
    if isinstance(content, list):
        texts: list[str] = []
        media = False
        for part in content:
            text, is_media = _part_text(part)
            texts.append(text)
            media = media or is_media
        return "".join(texts), media
    return "", False


def render_chat(messages: list[Any], tools: Any = None) -> tuple[str, bool]:
    """Render chat messages (and tools) into the text a model would see, in order."""
    pieces: list[str] = []
    media = False
    if tools:
        pieces.append("<|tools|>\n" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n")
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text, is_media = content_text(message.get("content"))
        media = media or is_media
        tool_calls = message.get("tool_calls")
        if tool_calls:
            text += json.dumps(tool_calls, sort_keys=True, separators=(",", ":"))
        pieces.append(f"<|{role if isinstance(role, str) else 'user'}|>\n{text}\n")
    return "".join(pieces), media


def render_completion_prompt(prompt: Any) -> str:
    """Render a /v1/completions prompt given as a string, a list of strings or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt)
        # Token ids (or a batch of them): their decimal form is a stable stand-in for the text.
        return json.dumps(prompt, separators=(",", ":"))
    return ""


def parse_request_body(path: str, raw: bytes) -> OpenAIRequest:
    """Parse a request body for ``path``; raises :class:`BodyError` when it is not usable."""
    if not raw:
        raise BodyError("empty body")
    try:
        body = orjson.loads(raw)  # twice as fast as json on long prompts
    except orjson.JSONDecodeError:
        # What orjson refuses and Python's json takes (NaN, integers beyond 64 bits, lone
        # surrogate escapes) a replica's server would take too: parse those the slow way.
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise BodyError(f"body is not JSON: {exc.__class__.__name__}") from None
        except RecursionError:
            raise BodyError("body JSON nests too deeply") from None
    if not isinstance(body, dict):
        raise BodyError("body is not a JSON object")
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    stream = body.get("stream") is True
    user = body.get("user")
    user = user if isinstance(user, str) and user else None
    media = False
    chat = None
    cap = max_output_tokens(body)
    if path in AGENT_PATHS:
        try:
            chat = messages_as_chat(body) if path == MESSAGES_PATH else responses_as_chat(body)
        except AgentApiError as exc:
            raise BodyError(str(exc)) from None
        prompt, media = render_chat(chat.messages, chat.tools)
        cap = agent_max_output_tokens(path, body)
    elif path.startswith(CHAT_PATH):
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BodyError("chat request without a messages list")
        prompt, media = render_chat(messages, body.get("tools"))
    else:
        prompt = render_completion_prompt(body.get("prompt"))
    return OpenAIRequest(
        model=model,
        prompt=prompt,
        stream=stream,
        user=user,
        body=body,
        has_media=media,
        max_output_tokens=cap,
        chat=chat,
    )
