"""The session ledger: each live session's replica and latest request, kept so that a session
can be moved (a replica joined, left, or runs hot) and pre-warmed on its new replica before its
next turn. Bounded by count and by bytes; the least recently used sessions go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class LedgerEntry:
    """One session as last routed."""

    session: str
    model: str
    replica: str
    path: str
    body: bytes
    last_seen: float
    moved_at: float = float("-inf")
    hashes: Sequence[int] = ()
    """The request's prefix block keys as the router looked them up (the tokenizer's, where one
    serves the model): a move indexes the session's new replica under the same keys."""


class SessionLedger:
    """session key -> :class:`LedgerEntry`, LRU-bounded by ``max_sessions`` and ``max_bytes``."""

    def __init__(self, max_sessions: int = 10_000, max_bytes: int = 64 * 1024 * 1024, ttl_s: float = 600.0) -> None:
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """Bytes of request bodies held."""
        return self._bytes

    @staticmethod
    def key(session: str, model: str) -> str:
        """The ledger key: sessions are per model, as in the stores."""
        return f"{model}\x1f{session}"

    def note(
        self,
        session: str,
        model: str,
        replica: str,
        path: str,
        body: bytes,
        now: float,
        hashes: Sequence[int] = (),
    ) -> None:
        """Remember a session's latest request (the body and its prefix keys ``hashes`` are
        referenced, not copied)."""
        key = self.key(session, model)
        old = self._entries.pop(key, None)
        moved_at = float("-inf")
        if old is not None:
            self._bytes -= len(old.body)
            moved_at = old.moved_at
        self._entries[key] = LedgerEntry(session, model, replica, path, body, now, moved_at, hashes)
        self._bytes += len(body)
        while self._entries and (len(self._entries) > self.max_sessions or self._bytes > self.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= len(dropped.body)

    def moved(self, session: str, model: str, replica: str, now: float) -> None:
        """Record that a session was moved to ``replica``."""
        entry = self._entries.get(self.key(session, model))
        if entry is not None:
            entry.replica = replica
            entry.moved_at = now

    def live(self, now: float) -> Iterator[LedgerEntry]:
        """Sessions seen within the TTL, least recently seen first."""
        horizon = now - self.ttl_s
        for entry in list(self._entries.values()):
            if entry.last_seen >= horizon:
                yield entry
