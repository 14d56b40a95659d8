"""Conversations without a session key, found among recent requests' message chains.

A chat request that carries no session key has its message chain
(:mod:`extproc.request.conversation`). Before it is routed, the chain's ``turn`` (its messages
before the last assistant turn) is looked up in the affinity store, which remembers, for each
recent request, the conversation its whole chain belongs to. Found, the request continues that
conversation; not found, or without an assistant turn, it opens one with an identity of its own
(drawn, not made from its messages: a burst of identical first turns is that many conversations,
placed apart, not one pinned to one replica). From
then on the request is routed as a keyed session is: its session key is the conversation's
(``conv-`` and 16 hex digits, in its tenant's key space), so it is pinned, counted among its
replica's live sessions and placed, when new, as a new session is. After the decision its chain's
``end`` is remembered, for its next turn to find.

The memory is the store's: bounded and expiring as the pins are (``sessions.max_sessions``,
``sessions.ttl_s``), in Redis shared by every gateway, in shared memory by every worker.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace

from extproc.request.conversation import Match
from extproc.request.features import RequestFeatures
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.state")


class Conversations:
    """Identifies keyless chat requests' conversations through an :class:`AffinityStore`."""

    def __init__(self, store: AffinityStore, new_identity: Callable[[], int] | None = None) -> None:
        self.store = store
        draw = random.Random()
        self.new_identity = new_identity or (lambda: draw.getrandbits(64))
        """A new conversation's identity (injected where runs must repeat)."""

    async def identify(self, features: RequestFeatures, now: float, *, peek: bool = False) -> RequestFeatures:
        """``features`` with the session key of its conversation, when it has a chain and no key;
        as they are otherwise. With ``peek`` (Explain) no TTL slides. A failing store makes the
        request a new conversation, never an error."""
        chain = features.conversation
        if chain is None or features.session_key is not None or chain.match is not None:
            return features
        found = None
        if chain.turn is not None:
            try:
                found = await self.store.conversation(chain.turn, now, model=features.model, refresh=not peek)
            except Exception as exc:  # the store is an optimisation: the conversation starts anew
                log.debug("conversation lookup failed: %s", exc)
        match: Match = "new" if chain.turn is None else "continued" if found is not None else "unmatched"
        resolved = replace(chain, conversation=found if found is not None else self.new_identity(), match=match)
        key = resolved.session_key
        if key is not None and features.tenant:
            key = f"{features.tenant}\x1f{key}"  # as a header's key: tenants never share conversations
        return replace(features, session_key=key, conversation=resolved)

    async def remember(self, features: RequestFeatures, now: float) -> None:
        """Remember the request's whole chain as its conversation's, for the next turn to find."""
        chain = features.conversation
        if chain is None or chain.conversation is None:
            return
        await self.store.remember_conversation(chain.end, chain.conversation, now, model=features.model)
        if chain.also is not None:  # the response this request makes, for previous_response_id
            await self.store.remember_conversation(chain.also, chain.conversation, now, model=features.model)
