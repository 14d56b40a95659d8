"""Conversations without a session key, found through the affinity store."""

from __future__ import annotations

import json

from extproc.request import FeatureSettings, extract_features
from extproc.request.features import RequestFeatures
from extproc.state import MemoryStore
from extproc.state.conversations import Conversations

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def features(messages: list[dict[str, str]], **headers: str) -> RequestFeatures:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return extract_features({":path": CHAT, **headers}, body, FeatureSettings())


def turns() -> list[list[dict[str, str]]]:
    first = [SYSTEM, {"role": "user", "content": "q1"}]
    second = [*first, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    third = [*second, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    return [first, second, third]


async def test_a_conversations_turns_share_one_session_key_once_remembered() -> None:
    book = Conversations(MemoryStore())
    keys, matches = [], []
    for messages in turns():
        f = await book.identify(features(messages), 1.0)
        assert f.conversation is not None
        keys.append(f.session_key)
        matches.append(f.conversation.match)
        await book.remember(f, 1.0)
    assert matches == ["new", "continued", "continued"]
    assert len(set(keys)) == 1 and keys[0] is not None and keys[0].startswith("conv-")


async def test_a_turn_of_a_forgotten_conversation_opens_its_own() -> None:
    book = Conversations(MemoryStore())
    second = await book.identify(features(turns()[1]), 1.0)
    assert second.conversation is not None and second.conversation.match == "unmatched"
    assert second.conversation.conversation not in (None, second.conversation.end)  # its own, drawn
    await book.remember(second, 1.0)
    third = await book.identify(features(turns()[2]), 2.0)
    assert third.conversation is not None and third.conversation.match == "continued"
    assert third.session_key == second.session_key


async def test_conversations_expire_with_the_session_ttl_and_explain_slides_nothing() -> None:
    store = MemoryStore(ttl_s=10.0)
    book = Conversations(store)
    await book.remember(await book.identify(features(turns()[0]), 0.0), 0.0)
    peeked = await book.identify(features(turns()[1]), 9.0, peek=True)
    assert peeked.conversation is not None and peeked.conversation.match == "continued"
    late = await book.identify(features(turns()[1]), 10.5)  # the peek did not slide the TTL
    assert late.conversation is not None and late.conversation.match == "unmatched"


async def test_keyed_requests_are_left_as_they_are_and_tenants_keep_their_own_space() -> None:
    book = Conversations(MemoryStore())
    keyed = features(turns()[0], **{"x-session-id": "s"})
    assert await book.identify(keyed, 0.0) is keyed
    tenant = await book.identify(
        extract_features(
            {":path": CHAT, "x-tenant-id": "acme"},
            json.dumps({"model": "m", "messages": turns()[0]}).encode(),
            FeatureSettings(tenant_header="x-tenant-id"),
        ),
        0.0,
    )
    assert tenant.session_key is not None and tenant.session_key.startswith("acme\x1fconv-")


class BrokenStore(MemoryStore):
    async def conversation(self, turn: int, now: float, *, model: str = "", refresh: bool = True) -> int | None:
        raise ConnectionError("store away")


async def test_a_failing_store_opens_a_conversation_instead_of_failing() -> None:
    f = await Conversations(BrokenStore()).identify(features(turns()[1]), 0.0)
    assert f.conversation is not None and f.conversation.match == "unmatched" and f.session_key is not None


async def test_conversations_opening_with_the_same_messages_share_one_identity() -> None:
    # A known limit, stated in docs/routing.md: the answers that would tell them apart are not
    # seen before the second turn, which finds the chain both first turns ended with.
    book = Conversations(MemoryStore())
    opening = [SYSTEM, {"role": "user", "content": "hello"}]
    first = await book.identify(features(opening), 0.0)
    await book.remember(first, 0.0)
    keys = set()
    for answer in ("hi there", "good morning"):
        later = await book.identify(
            features([*opening, {"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]), 1.0
        )
        keys.add(later.session_key)
    assert keys == {first.session_key}


async def test_identical_first_turns_are_as_many_conversations() -> None:
    # A burst of the same opening (a benchmark, a popular first question) is not one session
    # pinned to one replica: each first turn gets an identity of its own.
    book = Conversations(MemoryStore())
    opening = [SYSTEM, {"role": "user", "content": "hello"}]
    firsts = [await book.identify(features(opening), 0.0) for _ in range(8)]
    assert len({f.session_key for f in firsts}) == 8
    for f in firsts:
        await book.remember(f, 0.0)
    later = await book.identify(
        features([*opening, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]), 1.0
    )
    assert later.session_key == firsts[-1].session_key  # the chain's last remembered conversation
