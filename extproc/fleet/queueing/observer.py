"""What the fair queue reports: how many wait, how long they waited, how their wait ended; and
how long a request waited for KV room."""

from __future__ import annotations

from typing import Protocol


class QueueObserver(Protocol):
    """Where the fair queue reports (the router's metrics implement it)."""

    def queue_depth(self, priority: int, count: int) -> None:
        """``count`` requests now wait at ``priority``."""
        ...

    def queue_waited(self, request_class: str, seconds: float) -> None:
        """A request of ``request_class`` waited ``seconds`` (released, or past its limit)."""
        ...

    def queue_outcome(self, request_class: str, outcome: str) -> None:
        """A held request's wait ended: dispatched, timeout, full or gone."""
        ...

    def kv_room_waited(self, seconds: float) -> None:
        """A routed request waited ``seconds`` for KV room on its replica (0: it went at once)."""
        ...


class NullQueueObserver:
    """The default: nothing is reported."""

    def queue_depth(self, priority: int, count: int) -> None:
        """Not reported."""

    def queue_waited(self, request_class: str, seconds: float) -> None:
        """Not reported."""

    def queue_outcome(self, request_class: str, outcome: str) -> None:
        """Not reported."""

    def kv_room_waited(self, seconds: float) -> None:
        """Not reported."""
