"""Token budgets shared by every gateway of one Redis: one atomic round trip per charge.

A subject's windows are two keys in one hash slot (``{budget:NS:SUBJECT}:minute:START``, ``...:day:START``)
so a Redis Cluster serves them from one node. A charge adds to both and sets their expiry in one
script; a read fetches both with one MGET. Errors reach the ledger
(:class:`extproc.budgets.BudgetLedger`), which then answers from this gateway's own counts.
"""

from __future__ import annotations

from typing import Any

from extproc.budgets import WINDOWS, window_start

CHARGE = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('INCRBYFLOAT', key, ARGV[1])
  redis.call('EXPIRE', key, ARGV[i + 1])
end
return out
"""


class RedisBudgetStore:
    """The :class:`~extproc.budgets.BudgetStore` in Redis (``client``: a redis.asyncio client)."""

    def __init__(self, client: Any, namespace: str = "extproc") -> None:
        self.client = client
        self.namespace = namespace

    def _keys(self, subject: str, now: float) -> list[str]:
        tag = f"{{budget:{self.namespace}:{subject}}}"
        return [f"{tag}:{name}:{window_start(length, now)}" for name, length in WINDOWS]

    async def charge(self, subject: str, tokens: float, now: float) -> dict[str, float]:
        """Add ``tokens`` to the subject's current windows; their new totals."""
        keys = self._keys(subject, now)
        # Each key outlives its window by a minute, so a late read of a window just over finds it.
        ttls = [str(length + 60) for _, length in WINDOWS]
        totals = await self.client.eval(CHARGE, len(keys), *keys, repr(float(tokens)), *ttls)
        return {name: float(v) for (name, _), v in zip(WINDOWS, totals, strict=True)}

    async def used(self, subject: str, now: float) -> dict[str, float]:
        """The subject's current windows' totals (0 for a window nothing was charged to)."""
        values = await self.client.mget(self._keys(subject, now))
        return {name: float(v) if v is not None else 0.0 for (name, _), v in zip(WINDOWS, values, strict=True)}
