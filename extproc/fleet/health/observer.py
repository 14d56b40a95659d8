"""What health tracking reports: failed scrapes and replicas leaving the rotation."""

from __future__ import annotations

from typing import Protocol


class HealthObserver(Protocol):
    """Where the scraper reports (the router's metrics implement it)."""

    def scrape_failed(self, replica: str) -> None:
        """A scrape of ``replica``'s /metrics page failed."""
        ...

    def left_rotation(self, replica: str) -> None:
        """``replica`` was taken out of the rotation."""
        ...


class NullHealthObserver:
    """The default: nothing is reported."""

    def scrape_failed(self, replica: str) -> None:
        """Not reported."""

    def left_rotation(self, replica: str) -> None:
        """Not reported."""
