"""Conversation chains: what identifies a keyless chat request's conversation."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from extproc.request import FeatureSettings, extract_features, model_seed
from extproc.request.conversation import conversation_chain, conversation_key

CHAT = "/v1/chat/completions"
SEED = model_seed("m")
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_a_continuations_turn_is_the_chain_its_previous_request_ended_with() -> None:
    first = [SYSTEM, user("what is a prefix cache?")]
    second = [*first, assistant("a cache of KV blocks"), user("and a block?")]
    third = [*second, assistant("sixteen tokens"), user("thanks")]
    one, two, three = (conversation_chain(m, None, SEED) for m in (first, second, third))
    assert one is not None and two is not None and three is not None
    assert one.turn is None and one.messages == 2  # no assistant turn: it opens a conversation
    assert two.turn == one.end and two.turn_messages == 2
    assert three.turn == two.end and three.turn_messages == 4
    assert len({one.end, two.end, three.end}) == 3


def test_conversations_sharing_only_a_system_prompt_are_told_apart() -> None:
    a = conversation_chain([SYSTEM, user("how do I reset my password?")], None, SEED)
    b = conversation_chain([SYSTEM, user("where is my invoice?")], None, SEED)
    assert a is not None and b is not None and a.end != b.end
    # ... and so are their next turns, even with the same answer and the same question.
    a2 = conversation_chain([SYSTEM, user("how do I reset my password?"), assistant("ok"), user("?")], None, SEED)
    b2 = conversation_chain([SYSTEM, user("where is my invoice?"), assistant("ok"), user("?")], None, SEED)
    assert a2 is not None and b2 is not None and a2.turn == a.end and b2.turn == b.end and a2.end != b2.end


def test_the_chain_covers_roles_tool_calls_tools_and_the_model() -> None:
    base = [SYSTEM, user("x")]
    chain = conversation_chain(base, None, SEED)
    assert chain is not None
    others = [
        conversation_chain([SYSTEM, {"role": "assistant", "content": "x"}], None, SEED),
        conversation_chain(base, [{"type": "function", "function": {"name": "f"}}], SEED),
        conversation_chain(base, None, model_seed("other")),
        conversation_chain([SYSTEM, {**user("x"), "tool_calls": [{"id": "1"}]}], None, SEED),
        conversation_chain([SYSTEM, {"role": "tool", "content": "x", "tool_call_id": "1"}], None, SEED),
    ]
    assert all(o is not None and o.end != chain.end for o in others)
    # Content given as parts hashes as the same text.
    parts = conversation_chain([SYSTEM, {"role": "user", "content": [{"type": "text", "text": "x"}]}], None, SEED)
    assert parts is not None and parts.end == chain.end


def test_odd_messages_hash_without_failing() -> None:
    chain = conversation_chain(["not a message", {"role": 3, "content": {"x": 1}}, None], None, SEED)
    assert chain is not None and chain.turn is None
    assert conversation_chain([], None, SEED) is None


def test_only_keyless_chat_requests_carry_a_chain() -> None:
    settings = FeatureSettings()
    body = json.dumps({"model": "m", "messages": [SYSTEM, user("hi")]}).encode()
    keyless = extract_features({":path": CHAT}, body, settings)
    assert keyless.session_key is None and keyless.conversation is not None
    assert keyless.conversation.match is None and keyless.conversation.session_key is None
    keyed = extract_features({":path": CHAT, "x-session-id": "s"}, body, settings)
    assert keyed.session_key == "s" and keyed.conversation is None
    completion = extract_features(
        {":path": "/v1/completions"}, json.dumps({"model": "m", "prompt": "p"}).encode(), settings
    )
    assert completion.conversation is None
    off = FeatureSettings(conversations=False)
    assert extract_features({":path": CHAT}, body, off).conversation is None


def test_a_conversation_key_is_sixteen_hex_digits() -> None:
    assert conversation_key(255) == "conv-00000000000000ff"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "x"]), c),
    max_leaves=12,
)


@given(st.lists(_json, max_size=6), _json)
def test_any_json_messages_hash_and_a_resent_history_continues(messages: list[object], tools: object) -> None:
    chain = conversation_chain(messages, tools, SEED)
    if not messages:
        assert chain is None
        return
    assert chain is not None and 0 <= chain.turn_messages <= chain.messages == len(messages)
    follow = conversation_chain([*messages, assistant("a"), user("q")], tools, SEED)
    assert follow is not None and follow.turn == chain.end
