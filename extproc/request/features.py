"""From request headers and body bytes to :class:`RequestFeatures`, the routing layer's only input
about a request. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from extproc.request.agent_apis import RESPONSES_PATH, conversation_id, previous_response_id
from extproc.request.agent_hints import NO_HINTS, AgentHints, read_hints
from extproc.request.classes import ClassRule, classify
from extproc.request.conversation import ConversationChain, conversation_chain, response_chain, response_link
from extproc.request.objectives import Objectives, fill
from extproc.request.openai_body import INFERENCE_PATHS, BodyError, OpenAIRequest, parse_request_body
from extproc.request.prefix import block_hashes, model_seed
from extproc.request.session import SessionSource, session_key
from extproc.request.subset import SUBSET_KEY, decode_subset
from extproc.request.tenant import resolve_tenant

CHARS_PER_TOKEN = 4
SLO_TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
SLO_TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
"""The request's latency objectives, in milliseconds: ours first, then llm-d's names."""


@dataclass(frozen=True, slots=True)
class FeatureSettings:
    """How features are extracted: the request layer's view of the config's ``request:``,
    ``prefix:``, ``tenants:`` and ``classes:`` (``Config.features`` gathers it once). Its defaults
    are those sections' defaults, which read them from here."""

    session_sources: tuple[SessionSource, ...] = (
        SessionSource("header", "x-session-id"),
        # Agents' own session headers, as llm-d's agent-identity plugin reads them: Claude Code's
        # and OpenCode's (an agent that names its session is kept on one replica without a key).
        SessionSource("header", "x-claude-code-session-id"),
        SessionSource("header", "x-session-affinity"),
        SessionSource("cookie", "session_id"),
        SessionSource("body", "metadata.session_id"),
        SessionSource("body", "user"),
    )
    tenant_header: str = ""
    """The header naming the tenant, read only when the gateway itself sets it (config
    ``tenants.trust_header``; usually ``TENANT_HEADER``); empty: none is read."""
    block_chars: int = 64
    max_blocks: int = 2048
    max_body_bytes: int = 8 * 1024 * 1024
    api_keys: Mapping[str, str] = field(default_factory=dict)
    classes: tuple[ClassRule, ...] = ()
    tenant_objectives: Mapping[str, Objectives] = field(default_factory=dict)
    """Per tenant: the objectives its requests are held to when neither they nor their class say."""
    conversations: bool = True
    """Whether a chat request without a session key is given its conversation's chain
    (:mod:`extproc.request.conversation`), for the router to know its conversation by."""


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the decision needs to know about one request."""

    path: str
    model: str = ""
    session_key: str | None = None
    tenant: str = ""
    prompt_chars: int = 0
    prefix_hashes: tuple[int, ...] = ()
    stream: bool = False
    max_output_tokens: int | None = None
    has_media: bool = False
    body_error: str | None = None
    request_id: str = ""
    request_class: str = "default"
    pool: tuple[tuple[str, str], ...] = ()
    profile: str | None = None
    prompt_tokens: int = 0
    """The prompt's length in the model's tokens, where a tokenizer is configured (else 0)."""
    tokens_per_block: int = 0
    """Set when ``prefix_hashes`` are over the model's tokens (the engine's KV blocks), not characters."""
    slo_ttft_ms: float | None = None
    """The time-to-first-token objective: its class's or its tenant's default, or the client's
    (``x-slo-ttft-ms``) where it is stricter or there is no default (:mod:`extproc.request.objectives`)."""
    slo_tpot_ms: float | None = None
    """The time-per-output-token objective (``x-slo-tpot-ms``), filled the same way."""
    body_bytes: int = 0
    """The body's length as the router got it (a body not parsed is charged by it)."""
    subset: frozenset[str] | None = None
    """The endpoints the gateway offers for this request (its subset hint, :mod:`extproc.request.subset`):
    None without a hint; the decision picks only among these."""
    conversation: ConversationChain | None = None
    """For a chat request without a session key: its message chain, by which the router finds
    its conversation (then ``session_key`` is the conversation's, ``conversation.match`` how)."""
    response_id: str | None = None
    """For a Responses API request: the id its response will have (its ``request_id``)."""
    hints: AgentHints = NO_HINTS
    """What an agent framework said of it: priority, expected output, KV retention
    (:mod:`extproc.request.agent_hints`)."""

    @property
    def expected_output_tokens(self) -> int | None:
        """The output the decode is expected to make: the agent's estimate (Dynamo's ``osl``),
        else the request's cap; None when neither is given."""
        cap = self.max_output_tokens if self.max_output_tokens and self.max_output_tokens > 0 else None
        hint = self.hints.expected_output_tokens
        return min(hint, cap) if hint is not None and cap is not None else hint or cap

    @property
    def opens_conversation(self) -> bool:
        """Whether the request, where the router holds no pin for its session, opens a conversation
        that will choose where it lives (and so is placed by the conversations it will join): a
        session key, except a keyless request whose messages continue a conversation the router
        does not remember (``unmatched``: its history is already somewhere, and the blocks it holds
        say where, as a pin would; placed as a new conversation, a few such requests with one
        history left the replica holding it from the second on)."""
        chain = self.conversation
        return bool(self.session_key) and not (chain is not None and chain.match == "unmatched")

    @property
    def estimated_prompt_tokens(self) -> int:
        """The prompt's tokens where known, else an estimate: about four characters a token."""
        return self.prompt_tokens or self.prompt_chars // CHARS_PER_TOKEN

    def charged_prompt_tokens(self, bytes_per_token: float = CHARS_PER_TOKEN) -> int:
        """The prompt tokens a budget reserves and, when the response reports none, charges: the
        estimate, or for a body that was not parsed (over ``max_body_bytes``, not JSON, another
        path's) its size at ``bytes_per_token`` (``budgets.bytes_per_token``)."""
        return self.estimated_prompt_tokens or int(self.body_bytes / bytes_per_token)


def objective_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    """The first of ``names`` that holds a positive, finite number of milliseconds; anything else
    is ignored (a bad header must not fail the request)."""
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw.strip()[:32])
        except ValueError:
            continue
        if 0.0 < value < math.inf:
            return value
    return None


def request_path(headers: Mapping[str, str]) -> str:
    """The path without its query string."""
    return headers.get(":path", "").split("?", 1)[0]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A request read once: its features and its OpenAI body as parsed (None when it has no usable
    body). Splits, the tokenizer and hot keys take the parsed body from here: a long prompt's
    JSON is decoded once per request."""

    features: RequestFeatures
    body: OpenAIRequest | None = None


def extract_features(headers: Mapping[str, str], body: bytes | None, settings: FeatureSettings) -> RequestFeatures:
    """Extract features; a body that cannot be used leaves ``body_error`` set, never raises."""
    return read_request(headers, body, settings).features


def read_request(
    headers: Mapping[str, str], body: bytes | None, settings: FeatureSettings, *, hashed: bool = True
) -> ParsedRequest:
    """The request's features and parsed body; a body that cannot be used leaves ``body_error``
    set, never raises. Without ``hashed`` its prompt is not hashed yet (no block hashes, no
    conversation chain): the router hashes it once it knows the model served (a split's arm) and
    whether a tokenizer keys its blocks (:func:`with_chain`, :func:`with_block_hashes`)."""
    path = request_path(headers)
    tenant = resolve_tenant(headers, settings.tenant_header, settings.api_keys)
    request_id = headers.get("x-request-id", "")[:128]
    body_error: str | None = None
    parsed = None
    if body is not None and path in INFERENCE_PATHS:
        if len(body) > settings.max_body_bytes:
            body_error = f"body of {len(body)} bytes is over the {settings.max_body_bytes}-byte limit"
        else:
            try:
                parsed = parse_request_body(path, body)
            except BodyError as exc:
                body_error = str(exc)
    elif body is None and path in INFERENCE_PATHS:
        body_error = "no body"
    key = session_key(settings.session_sources, headers, parsed.body if parsed else None)
    if key is None and parsed is not None and path == RESPONSES_PATH and (conv := conversation_id(parsed.body)):
        key = f"conversation:{conv}"  # the Responses API's own conversation object: a session
    if key is not None and tenant:
        # Tenants live in their own key space: equal session ids of two tenants are two sessions.
        key = f"{tenant}\x1f{key}"
    if parsed is None:
        features = RequestFeatures(
            path=path,
            session_key=key,
            tenant=tenant,
            body_bytes=len(body) if body is not None else 0,
            body_error=body_error,
            request_id=request_id,
            model=headers.get("x-model", "")[:256],
            slo_ttft_ms=objective_ms(headers, SLO_TTFT_HEADERS),
            slo_tpot_ms=objective_ms(headers, SLO_TPOT_HEADERS),
            hints=read_hints(headers, None),
        )
        return ParsedRequest(_classified(features, headers, settings))
    bare = RequestFeatures(path=path, session_key=key, tenant=tenant, request_id=request_id)
    return ParsedRequest(_from_body(bare, parsed, headers, settings, hashed), parsed)


def with_model(
    request: ParsedRequest, model: str, headers: Mapping[str, str], settings: FeatureSettings, *, hashed: bool = True
) -> ParsedRequest:
    """``request`` as if its body named ``model`` (a split's arm): the prefix hashes are seeded
    with the model actually served. The body is not parsed again."""
    if request.body is None:
        return request
    body = replace(request.body, model=model, body={**request.body.body, "model": model})
    return ParsedRequest(_from_body(request.features, body, headers, settings, hashed), body)


def with_chain(request: ParsedRequest, settings: FeatureSettings) -> ParsedRequest:
    """A request read without ``hashed``, with its conversation chain (where it has one)."""
    parsed, features = request.body, request.features
    if parsed is None or features.conversation is not None:
        return request
    chain = _chain(features, parsed, model_seed(parsed.model), settings)
    return request if chain is None else ParsedRequest(replace(features, conversation=chain), parsed)


def with_block_hashes(
    features: RequestFeatures, parsed: OpenAIRequest | None, settings: FeatureSettings
) -> RequestFeatures:
    """``features`` (of a request read without ``hashed``) with its prompt's character block
    hashes, unless a tokenizer already keyed its blocks."""
    if parsed is None or features.tokens_per_block or features.prefix_hashes:
        return features
    hashes = block_hashes(parsed.prompt, model_seed(parsed.model), settings.block_chars, settings.max_blocks)
    return replace(features, prefix_hashes=hashes)


def with_response_id(
    request: ParsedRequest, response_id: str, headers: Mapping[str, str], settings: FeatureSettings
) -> ParsedRequest:
    """A Responses API ``request`` given the id its response will have (vLLM names a response by
    its request's ``request_id``): a later request naming it as ``previous_response_id`` is then
    known. The body is not parsed again, nor hashed: as the router reads a request, its chain and
    hashes come after (:func:`with_chain`, :func:`with_block_hashes`)."""
    if request.body is None:
        return request
    body = replace(request.body, body={**request.body.body, "request_id": response_id})
    return ParsedRequest(_from_body(request.features, body, headers, settings, hashed=False), body)


def _from_body(
    bare: RequestFeatures,
    parsed: OpenAIRequest,
    headers: Mapping[str, str],
    settings: FeatureSettings,
    hashed: bool = True,
) -> RequestFeatures:
    hashes: tuple[int, ...] = ()
    chain = None
    if hashed:
        seed = model_seed(parsed.model)
        hashes = block_hashes(parsed.prompt, seed, settings.block_chars, settings.max_blocks)
        chain = _chain(bare, parsed, seed, settings)
    features = RequestFeatures(
        path=bare.path,
        model=parsed.model,
        session_key=bare.session_key,
        tenant=bare.tenant,
        prompt_chars=len(parsed.prompt),
        prefix_hashes=hashes,
        stream=parsed.stream,
        max_output_tokens=parsed.max_output_tokens,
        has_media=parsed.has_media,
        request_id=bare.request_id,
        # From the headers, not ``bare``: a split's arm may change the class, and so its defaults.
        slo_ttft_ms=objective_ms(headers, SLO_TTFT_HEADERS),
        slo_tpot_ms=objective_ms(headers, SLO_TPOT_HEADERS),
        conversation=chain,
        response_id=_response_id(bare.path, parsed.body),
        hints=read_hints(headers, parsed.body),
    )
    return _classified(features, headers, settings)


def _response_id(path: str, body: Mapping[str, object]) -> str | None:
    own = body.get("request_id") if path == RESPONSES_PATH else None
    return own if isinstance(own, str) and own else None


def _chain(
    bare: RequestFeatures, parsed: OpenAIRequest, seed: int, settings: FeatureSettings
) -> ConversationChain | None:
    """The chain a request without a session key is known by: its messages' (chat, and the
    Messages and Responses APIs as the engine's chat request), or for a Responses request that
    names ``previous_response_id`` that response's, whatever ``request.conversations`` says (the
    engine holds that conversation in its own memory: the turn must go where it was made)."""
    if bare.session_key is not None:
        return None
    body = parsed.body
    if bare.path == RESPONSES_PATH:
        own = body.get("request_id")
        own = own if isinstance(own, str) and own else None
        previous = previous_response_id(body)
        messages = len(parsed.chat.messages) if parsed.chat is not None else 0
        if previous is not None:
            return response_chain(previous, own, bare.tenant, seed, messages)
        if not settings.conversations or parsed.chat is None:
            return None
        chain = conversation_chain(parsed.chat.messages, parsed.chat.tools, seed)
        if chain is not None and own is not None:
            chain = replace(chain, also=response_link(own, bare.tenant, seed))
        return chain
    if not settings.conversations:
        return None
    if parsed.chat is not None:
        return conversation_chain(parsed.chat.messages, parsed.chat.tools, seed)
    listed = body.get("messages")
    return conversation_chain(listed, body.get("tools"), seed) if isinstance(listed, list) else None


def _classified(features: RequestFeatures, headers: Mapping[str, str], settings: FeatureSettings) -> RequestFeatures:
    """The request's class (the first rule that matches), the objectives its class or its
    tenant gives where its headers give none, and the gateway's subset hint."""
    subset = decode_subset(headers.get(SUBSET_KEY))
    if subset is not None:
        features = replace(features, subset=subset)
    rule = None
    if settings.classes:
        rule = classify(
            settings.classes,
            features.estimated_prompt_tokens,
            features.stream,
            features.has_media,
            features.model,
            headers,
        )
    if rule is not None:
        features = replace(
            features, request_class=rule.name, pool=tuple(sorted(rule.pool.items())), profile=rule.profile
        )
    tenant = settings.tenant_objectives.get(features.tenant) if settings.tenant_objectives else None
    if (rule is None or rule.objectives is None) and tenant is None:
        return features
    ttft, tpot = fill(features.slo_ttft_ms, features.slo_tpot_ms, rule.objectives if rule else None, tenant)
    return replace(features, slo_ttft_ms=ttft, slo_tpot_ms=tpot)


def uncached_tokens(features: RequestFeatures, matched_blocks: int, block_chars: int) -> int:
    """Prompt tokens a replica holding ``matched_blocks`` of the prompt's leading blocks would
    prefill (blocks of the model's tokens where tokenized, else of ``block_chars`` characters)."""
    if features.tokens_per_block:
        return max(0, features.prompt_tokens - matched_blocks * features.tokens_per_block)
    return max(0, features.prompt_chars - matched_blocks * block_chars) // CHARS_PER_TOKEN
