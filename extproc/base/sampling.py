"""Deterministic sampling at a rate: a share of events taken evenly, with no random source."""

from __future__ import annotations


class RateSampler:
    """Takes ``rate`` of the events it is asked about, evenly: the rate accumulates and an event
    is taken at each whole one (0.25 takes exactly every fourth). A rate of 1 or more takes all,
    0 or less none."""

    __slots__ = ("_credit",)

    def __init__(self) -> None:
        self._credit = 0.0

    def take(self, rate: float) -> bool:
        """Whether to take this event at ``rate``."""
        if rate >= 1.0:
            return True
        if rate <= 0.0:
            return False
        self._credit += rate
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False
