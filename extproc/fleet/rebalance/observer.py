"""What rebalancing reports: sessions moved, re-pins that failed, pre-warm outcomes."""

from __future__ import annotations

from typing import Protocol


class RebalanceObserver(Protocol):
    """Where the rebalancer reports (the router's metrics implement it)."""

    def session_moved(self, reason: str) -> None:
        """A session was moved to another replica; ``reason`` is join, leave or hot."""
        ...

    def repin_failed(self) -> None:
        """Re-pinning a moved session in the store failed (the session stays where it was)."""
        ...

    def prewarmed(self, outcome: str) -> None:
        """A pre-warm request ended: ok, error, dropped or unusable."""
        ...


class NullRebalanceObserver:
    """The default: nothing is reported."""

    def session_moved(self, reason: str) -> None:
        """Not reported."""

    def repin_failed(self) -> None:
        """Not reported."""

    def prewarmed(self, outcome: str) -> None:
        """Not reported."""
