"""The affinity store: where sessions are pinned and which replicas hold which prefix blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.routing.model import AffinityView


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Sizes a store reports for metrics and bounds checks."""

    sessions: int
    prefix_blocks: int


class AffinityStore(Protocol):
    """Session pins with a sliding TTL and an approximate prefix index.

    ``lookup`` also refreshes the session's TTL (a session in use never expires). ``now`` is the
    caller's clock, so stores never read time themselves.
    """

    async def lookup(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """What is known for a request: its pinned replica and the replicas holding its prefix.

        Sessions are kept per ``model`` (a conversation's KV cache is per model); prefix hashes
        are already seeded with the model name.
        """
        ...

    async def record(
        self,
        session_key: str | None,
        replica: str,
        prefix_hashes: Sequence[int],
        now: float,
        pin: bool,
        *,
        model: str = "",
    ) -> None:
        """Remember a decision: pin the session (when ``pin``) and index the prefix on ``replica``."""
        ...

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound how many prefix blocks ``replica`` is believed to hold: its KV cache as it
        reports it. Beyond it, the least recently routed blocks are no longer claimed."""
        ...

    async def forget_replica(self, replica: str) -> None:
        """Drop a replica's prefix entries (it left, or its cache is gone).

        Pins to it may outlive this (the memory store drops them too; Redis keeps them until their
        TTL): a pin to a replica that is not a candidate is passed over at decision time, and the
        session's next request pins it anew.
        """
        ...

    async def peek(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """What :meth:`lookup` would return, without refreshing a TTL or touching any cache (the
        admin API's Explain and GetSession). Redis answers prefix matches from this gateway's mirror."""
        ...

    async def forget_session(self, session_key: str, *, model: str = "") -> bool:
        """Unpin a session; True if it was pinned."""
        ...

    async def conversation(self, turn: int, now: float, *, model: str = "", refresh: bool = True) -> int | None:
        """The conversation a recent request whose message chain ended with ``turn`` belonged to
        (:mod:`extproc.request.conversation`), its TTL slid unless ``refresh`` is False (Explain);
        None when no such request is remembered."""
        ...

    async def remember_conversation(self, end: int, conversation: int, now: float, *, model: str = "") -> None:
        """Remember that the request whose message chain ended with ``end`` belonged to
        ``conversation``, as long as a session's pin (the same TTL, sliding, and bound)."""
        ...

    async def cordons(self) -> dict[str, str]:
        """Replicas an operator cordoned or drained: name -> "cordoned" or "drained" (shared by every
        gateway of the store)."""
        ...

    async def set_cordon(self, replica: str, state: str | None) -> None:
        """Cordon (``"cordoned"``), drain (``"drained"``) or release (None) a replica."""
        ...

    def stats(self) -> StoreStats:
        """Current sizes."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class StoreObserver(Protocol):
    """Where a remote store reports what the router cannot see: its errors (a Redis store does
    not raise, it falls back), its latency and its availability. ``operation`` is one of a small
    fixed set (lookup, record, forget, probe): it becomes a metric label."""

    def store_error(self, operation: str) -> None:
        """One failed operation."""
        ...

    def store_latency(self, operation: str, seconds: float) -> None:
        """How long one operation took."""
        ...

    def store_available(self, available: bool) -> None:
        """The store became reachable (True) or unreachable (False)."""
        ...

    def store_queued(self, writes: int) -> None:
        """How many writes wait for the store (they pile up during an outage, drain after it)."""
        ...


class NullStoreObserver:
    """The default: nothing is reported."""

    def store_error(self, operation: str) -> None:
        """Not reported."""

    def store_latency(self, operation: str, seconds: float) -> None:
        """Not reported."""

    def store_available(self, available: bool) -> None:
        """Not reported."""

    def store_queued(self, writes: int) -> None:
        """Not reported."""
