"""Where the charged tokens are counted, per subject and fixed window: the protocol, and process
memory for one gateway (Redis for several: :mod:`extproc.state.redis_budgets`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from extproc.state.budgets.settings import WINDOWS


class BudgetStore(Protocol):
    """Where the charged tokens are counted, per subject and window."""

    async def charge(self, subjects: Sequence[str], tokens: float, now: float) -> None:
        """Add ``tokens`` to each of ``subjects``' current windows."""
        ...

    async def used(self, subjects: Sequence[str], now: float) -> list[dict[str, float]]:
        """Each subject's totals in its current windows, by window name, in the order given."""
        ...


def window_start(length_s: int, now: float) -> int:
    """The start of the fixed window of ``length_s`` that holds ``now`` (wall clock seconds)."""
    return int(now // length_s) * length_s


class MemoryBudgetStore:
    """Counts in process memory: the budgets of one gateway."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], float] = {}

    async def charge(self, subjects: Sequence[str], tokens: float, now: float) -> None:
        """Add, and forget windows that are over."""
        self.add(subjects, tokens, now)

    def add(self, subjects: Sequence[str], tokens: float, now: float) -> None:
        """:meth:`charge`, without waiting (it never does)."""
        for subject in subjects:
            for name, length in WINDOWS:
                key = (subject, name, window_start(length, now))
                self._counts[key] = self._counts.get(key, 0.0) + tokens
        if len(self._counts) > 4 * 1024:
            self._counts = {k: v for k, v in self._counts.items() if k[2] + dict(WINDOWS)[k[1]] > now}

    async def used(self, subjects: Sequence[str], now: float) -> list[dict[str, float]]:
        """The current windows' totals."""
        return [
            {name: self._counts.get((subject, name, window_start(length, now)), 0.0) for name, length in WINDOWS}
            for subject in subjects
        ]
