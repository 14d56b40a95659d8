"""Token budgets shared by every gateway of one Redis: one round trip for all of a request's budgets.

A subject's windows are two keys in one hash slot (``{budget:NS:SUBJECT}:minute:START``, ``...:day:START``)
so a Redis Cluster serves them from one node. A charge adds to both and sets their expiry in one
script; a read fetches both with one MGET. A request under several budgets (its tenant's, its API
key's, its model's) sends one such command per subject: pipelined on one server, side by side on
a Cluster (each to its slot's node; redis-py refuses scripts in a cluster pipeline), about one
round trip either way. Errors reach the ledger (:class:`extproc.state.budgets.ledger.BudgetLedger`), which
then answers from this gateway's own counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from extproc.state.budgets.settings import WINDOWS
from extproc.state.budgets.stores import window_start

CHARGE = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('INCRBYFLOAT', key, ARGV[1])
  redis.call('EXPIRE', key, ARGV[i + 1])
end
return out
"""
# Each key outlives its window by a minute, so a late read of a window just over finds it.
_TTLS = tuple(str(length + 60) for _, length in WINDOWS)


class RedisBudgetStore:
    """The :class:`~extproc.state.budgets.stores.BudgetStore` in Redis (``client``: a redis.asyncio client)."""

    def __init__(self, client: Any, namespace: str = "extproc") -> None:
        self.client = client
        self.namespace = namespace
        self._cluster = isinstance(client, RedisCluster)

    def _keys(self, subject: str, now: float) -> list[str]:
        tag = f"{{budget:{self.namespace}:{subject}}}"
        return [f"{tag}:{name}:{window_start(length, now)}" for name, length in WINDOWS]

    async def charge(self, subjects: Sequence[str], tokens: float, now: float) -> None:
        """Add ``tokens`` to each subject's current windows."""
        amount = repr(float(tokens))
        calls = [(CHARGE, len(WINDOWS), *self._keys(s, now), amount, *_TTLS) for s in subjects]
        if len(calls) == 1:
            await self.client.eval(*calls[0])
        elif self._cluster:
            await asyncio.gather(*(self.client.eval(*call) for call in calls))
        else:
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                pipe.eval(*call)
            await pipe.execute()

    async def used(self, subjects: Sequence[str], now: float) -> list[dict[str, float]]:
        """Each subject's current windows' totals (0 for a window nothing was charged to)."""
        keys = [self._keys(s, now) for s in subjects]
        if len(keys) == 1:
            replies = [await self.client.mget(keys[0])]
        elif self._cluster:
            replies = list(await asyncio.gather(*(self.client.mget(k) for k in keys)))
        else:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.mget(k)
            replies = await pipe.execute()
        return [
            {name: float(v) if v is not None else 0.0 for (name, _), v in zip(WINDOWS, values, strict=True)}
            for values in replies
        ]
