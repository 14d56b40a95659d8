"""What vLLM stores under each Responses answer made through here, to hash the next turn with it.

A Responses request naming ``previous_response_id`` is rendered by the engine after the
conversation it stored under that id (the earlier request's messages, its instructions left out,
and the answer's text). The router keeps that conversation per response it routed: the request's
messages when it is tokenized, the answer's once its body was read. Its next turn is then hashed
over the whole prompt the engine renders, in the engine's own key space.

Bounded (``capacity`` responses, least recently written out first, and the encoded bytes held
here under ``max_bytes``) and expiring with the sessions' TTL once :meth:`ResponseHistory.share`
was told it. With a Redis store the conversation is also written to Redis
(:mod:`extproc.state.redis_transcripts`) once answered, and a turn this process never saw is read
from there before it is tokenized: a follow-up that reaches another gateway is hashed as here.
Without Redis it stays in this process: a follow-up another worker or gateway routes is routed
by its pin alone (the pin itself is shared through the store, as every conversation's).

What Redis holds, per response: the request's messages (encoded in the tokenizing thread, when
the request is) and the answer's, each JSON compressed with zlib, at most
:data:`~extproc.request.agent_apis.TRANSCRIPT_BYTES` together; decoded by the thread that
tokenizes the follow-up, never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("extproc.fleet.kvevents")

Messages = list[dict[str, Any]]

_HEAD = 5  # a version byte and the request part's length


class SharedTranscripts(Protocol):
    """Where conversations are shared between gateways (in Redis:
    :class:`~extproc.state.redis_transcripts.RedisTranscripts`)."""

    max_bytes: int

    async def fetch(self, model: str, link: str) -> bytes | None:
        """The bytes kept for ``link``; None when there are none (or the store is away)."""
        ...

    def keep(self, model: str, link: str, payload: bytes) -> None:
        """Keep ``payload`` for ``link``, behind the caller."""
        ...

    async def close(self) -> None:
        """Stop writing."""
        ...


def link(tenant: str, response_id: str) -> str:
    """A response's name in the shared store: its tenant's and id's digest (a client may name
    its own ``request_id``: another tenant naming the same id never reads this one's)."""
    return hashlib.blake2b(f"{tenant}\x1f{response_id}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _encode(messages: Messages) -> bytes:
    return zlib.compress(json.dumps(messages, separators=(",", ":")).encode("utf-8", "surrogatepass"), 1)


def _decode(part: bytes) -> Messages:
    value = json.loads(zlib.decompress(part))
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError("not a list of messages")
    return value


def pack(asked: bytes, answer: bytes) -> bytes:
    """A conversation as shared: its request part (:func:`_encode`d) and its answer's."""
    return b"\x01" + len(asked).to_bytes(4, "big") + asked + answer


def unpack(payload: bytes) -> tuple[Messages, Messages]:
    """The request's messages and the answer's from :func:`pack`'s bytes (ValueError if not such)."""
    if len(payload) < _HEAD or payload[0] != 1:
        raise ValueError("not a transcript")
    size = int.from_bytes(payload[1:_HEAD], "big")
    try:
        return _decode(payload[_HEAD : _HEAD + size]), _decode(payload[_HEAD + size :])
    except zlib.error as exc:
        raise ValueError(str(exc)) from None


@dataclass(slots=True)
class _Turn:
    asked: Messages | None
    """The request's messages (instructions included: they do not carry over, left out when read)."""
    answer: Messages | None
    expires: float
    scope: tuple[str, str] | None = None
    """(model, link) in the shared store, when shared."""
    encoded: bytes | None = None
    """The request part, encoded for the shared store, until the answer is written with it."""
    raw: bytes | None = None
    """A conversation read from the shared store, decoded when first used."""

    @property
    def size(self) -> int:
        return len(self.encoded or b"") + len(self.raw or b"")


class ResponseHistory:
    """Per Responses answer made through here, the conversation its engine stores under its id."""

    def __init__(
        self,
        capacity: int = 4096,
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float | None = None,
        max_bytes: int = 64 << 20,
    ) -> None:
        self.capacity = capacity
        self.clock = clock
        self.ttl_s = ttl_s
        """How long a conversation is kept (the sessions' TTL); None: until pushed out."""
        self.max_bytes = max_bytes
        self.shared: SharedTranscripts | None = None
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # tokenizing threads write and read, the event loop reads answers in

    def share(self, shared: SharedTranscripts | None, ttl_s: float) -> None:
        """Keep conversations for ``ttl_s`` (the sessions' TTL), and share them through ``shared``
        (None: in this process only)."""
        self.shared, self.ttl_s = shared, ttl_s

    def _expires(self) -> float:
        return float("inf") if self.ttl_s is None else self.clock() + self.ttl_s

    def _put(self, response_id: str, turn: _Turn) -> None:
        """Under the lock: ``turn`` written, the oldest pushed out past the bounds."""
        old = self._turns.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        self._turns[response_id] = turn
        self._bytes += turn.size
        now = self.clock()
        while self._turns:
            first = next(iter(self._turns.values()))
            if len(self._turns) <= self.capacity and self._bytes <= self.max_bytes and first.expires > now:
                break
            self._bytes -= self._turns.popitem(last=False)[1].size

    def _get(self, response_id: str) -> _Turn | None:
        """Under the lock: the turn, unless expired."""
        turn = self._turns.get(response_id)
        return turn if turn is not None and turn.expires > self.clock() else None

    def asked(self, response_id: str, messages: Messages, *, tenant: str = "", model: str = "") -> None:
        """The request that makes ``response_id`` was rendered from ``messages`` (called by the
        tokenizing thread: with a shared store, its part of the conversation is encoded here)."""
        scope, encoded = None, None
        if self.shared is not None:
            encoded = _encode([m for m in messages if m.get("role") != "system"])
            if len(encoded) + _HEAD <= self.shared.max_bytes:
                scope = (model, link(tenant, response_id))
            else:
                encoded = None  # too long to share: the follow-up elsewhere goes by its pin alone
        with self._lock:
            self._put(response_id, _Turn(messages, None, self._expires(), scope, encoded))

    def answered(self, response_id: str, answer: Messages) -> None:
        """``response_id``'s answer, as the engine stores it (on the event loop: with a shared
        store, the conversation is written there behind the caller)."""
        with self._lock:
            turn = self._get(response_id)
            if turn is None:
                return
            turn.answer = answer
            encoded, scope = turn.encoded, turn.scope
            if encoded is not None:
                turn.encoded = None
                self._bytes -= len(encoded)
        if self.shared is not None and encoded is not None and scope is not None:
            self.shared.keep(scope[0], scope[1], pack(encoded, _encode(answer)))

    def conversation(self, response_id: str) -> Messages | None:
        """What the engine prepends to a request continuing ``response_id``; None when not known
        whole (not routed here nor shared, forgotten, or its answer not read)."""
        with self._lock:
            turn = self._get(response_id)
            raw = turn.raw if turn is not None else None
        if turn is None:
            return None
        if raw is not None:  # read from the shared store: decoded here, in the tokenizing thread
            try:
                asked, answer = unpack(raw)
            except ValueError as exc:
                log.debug("a shared Responses transcript is not readable: %s", exc)
                asked, answer = [], None
            with self._lock:
                if turn.raw is raw:
                    if self._turns.get(response_id) is turn:  # (one pushed out was uncounted then)
                        self._bytes -= len(raw)
                    turn.asked, turn.answer, turn.raw = asked, answer, None
        if turn.asked is None or turn.answer is None:
            return None
        return [m for m in turn.asked if m.get("role") != "system"] + turn.answer

    async def fetch(self, response_id: str, *, tenant: str = "", model: str = "") -> None:
        """Before a turn continuing ``response_id`` is tokenized: its conversation read from the
        shared store when this process does not know it (another gateway routed it)."""
        if self.shared is None:
            return
        with self._lock:
            if self._get(response_id) is not None:
                return
        raw = await self.shared.fetch(model, link(tenant, response_id))
        if raw is None:
            return
        with self._lock:
            if self._get(response_id) is None:
                self._put(response_id, _Turn(None, None, self._expires(), raw=raw))

    async def close(self) -> None:
        """Stop sharing (the writes in flight end first, briefly)."""
        if self.shared is not None:
            await self.shared.close()
