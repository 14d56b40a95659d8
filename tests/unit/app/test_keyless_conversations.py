"""Keyless chat conversations through the router, in process: pinned as sessions, explained."""

from __future__ import annotations

import json

from extproc.adapters.admin.service import explanation_message
from extproc.adapters.admin.tables import render
from extproc.app.router import Router
from extproc.routing import Reason
from tests.conftest import make_config

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are the assistant of a support desk. " * 60}


def body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


async def test_a_keyless_conversation_is_pinned_and_explain_says_how_it_was_known() -> None:
    router = Router(make_config())
    messages = [SYSTEM, {"role": "user", "content": "my order never arrived"}]
    first = await router.route({":path": CHAT}, body(messages))
    assert first.decision.reason is Reason.NEW_SESSION and first.decision.replica is not None
    assert first.features.session_key is not None and first.features.session_key.startswith("conv-")
    replica = first.decision.replica.name
    for turn in range(3):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
        explained = await router.explain({":path": CHAT}, body(messages))
        message = explanation_message(explained)
        assert (message.conversation, message.session) == ("continued", first.features.session_key)
        assert message.pinned == replica
        assert f"conversation continued (no session key; known by its messages): {message.session}" in render(
            "explain", message
        )
        routed = await router.route({":path": CHAT}, body(messages))
        assert routed.decision.reason is Reason.STICKY and routed.decision.replica is not None
        assert routed.decision.replica.name == replica
        assert routed.features.session_key == first.features.session_key
    counted = {
        s.labels["match"]: s.value
        for m in router.metrics.conversations.collect()
        for s in m.samples
        if s.name == "extproc_conversations_total"
    }
    assert counted == {"new": 1, "continued": 3}  # Explain counts nothing
    # A keyed request explains no conversation.
    keyed = explanation_message(await router.explain({":path": CHAT, "x-session-id": "s"}, body(messages)))
    assert (keyed.conversation, keyed.session) == ("", "s")
