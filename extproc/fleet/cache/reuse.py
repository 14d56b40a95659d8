"""Where the hit ratio goes: the reuse a workload offered, the share the routing captured, and what
the engine delivered, per pool and replica.

Three figures, each in its own units, so that a low hit ratio can be told to be the workload's,
the router's or the engine's:

- **offered**: of a routed prompt's prefix blocks, those some replica of its pool was believed to
  hold when it was decided (the most any one held, as the router's view weighs them). Low: the
  workload repeats little, and no routing can do better.
- **captured**: those the chosen replica was believed to hold. Captured over offered is the
  routing's share: 1 when every request went where its blocks were, 1/N for a random choice
  among N replicas holding nothing in common.
- **delivered**: what the engine reports itself (vLLM's ``prefix_cache_hits`` over
  ``prefix_cache_queries``, in tokens) since the router started. Its hit ratio over the
  captured ratio (captured over all the prompts' blocks) is the engine's share: below 1 when it
  had evicted what the router believed held, above 1 when it held more than the router knew.

A request is counted on the replica it was sent to, under that replica's ``pool`` label (``default``
without one); its offer is judged among the replicas of the same pool. The engine's counters are
read per replica: several gateways see the same engine, so its figures are not to be summed over
gateways, while the router's are. A replica that leaves the membership takes its account with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

DEFAULT_POOL = "default"
POOL_LABEL = "pool"


def pool_of(labels: Mapping[str, str]) -> str:
    """The pool a replica belongs to, by its ``pool`` label."""
    return labels.get(POOL_LABEL) or DEFAULT_POOL


@dataclass(slots=True)
class ReuseRow:
    """One replica's account since the router started."""

    pool: str
    replica: str
    prompt_blocks: int = 0
    """Prefix blocks of the prompts routed there."""
    offered_blocks: int = 0
    """Of those, the most any replica of the pool was believed to hold."""
    captured_blocks: int = 0
    """Of those, what the replica itself was believed to hold."""
    engine_queries_tokens: float = 0.0
    """Prompt tokens the engine looked up in its prefix cache since the router started (-1: it
    reports no counters)."""
    engine_hits_tokens: float = 0.0
    """Of those, the tokens it found cached."""


@dataclass(slots=True)
class _EngineCounter:
    """An engine's monotonic counter read across restarts: what it counted since first read."""

    first: float
    last: float
    before_restarts: float = 0.0

    def read(self, value: float) -> None:
        if value < self.last:  # the engine restarted: its counter began again at zero
            self.before_restarts += self.last - self.first
            self.first = 0.0
        self.last = value

    @property
    def since_first(self) -> float:
        return self.before_restarts + self.last - self.first


class ReuseLedger:
    """The three figures per replica, counted as requests are decided and engines are scraped."""

    def __init__(
        self, labels_of: Callable[[str], Mapping[str, str] | None], wall: Callable[[], float] = time.time
    ) -> None:
        self.since = wall()
        """Wall-clock seconds when counting began."""
        self.labels_of = labels_of
        """A member's labels by name (None: no longer a member)."""
        self._rows: dict[str, ReuseRow] = {}
        self._engine: dict[str, tuple[_EngineCounter, _EngineCounter]] = {}

    def _row(self, replica: str) -> ReuseRow:
        row = self._rows.get(replica)
        if row is None:
            row = self._rows[replica] = ReuseRow(pool_of(self.labels_of(replica) or {}), replica)
        return row

    def routed(self, replica: str, total_blocks: int, matches: Mapping[str, int], captured: int) -> None:
        """A request decided for ``replica``: its prefix blocks, how many each replica was believed
        to hold (``matches``), and how many the chosen one held."""
        if total_blocks <= 0:
            return
        row = self._row(replica)
        offered = captured
        for name, held in matches.items():
            if held > offered and pool_of(self.labels_of(name) or {}) == row.pool:
                offered = held
        row.prompt_blocks += total_blocks
        row.offered_blocks += min(offered, total_blocks)
        row.captured_blocks += min(captured, total_blocks)

    def engine_read(self, replica: str, hits: float | None, queries: float | None) -> None:
        """The engine's own prefix-cache counters as last scraped (None: it reports none)."""
        if hits is None or queries is None:
            return
        counters = self._engine.get(replica)
        if counters is None:
            self._engine[replica] = (_EngineCounter(hits, hits), _EngineCounter(queries, queries))
            self._row(replica)
            return
        counters[0].read(hits)
        counters[1].read(queries)

    def rows(self, members: list[str] | None = None) -> list[ReuseRow]:
        """Every replica's account, by pool then name. With ``members``, each gets a row even before
        any count, and the accounts of replicas no longer members are dropped (pods come and go
        under new names: kept, they would grow without bound)."""
        if members is not None:
            for name in set(self._rows) - set(members):
                del self._rows[name]
                self._engine.pop(name, None)
            for name in members:
                self._row(name)
        out = []
        for name, row in sorted(self._rows.items(), key=lambda item: (item[1].pool, item[0])):
            engine = self._engine.get(name)
            hits, queries = (engine[0].since_first, engine[1].since_first) if engine else (-1.0, -1.0)
            out.append(
                ReuseRow(row.pool, name, row.prompt_blocks, row.offered_blocks, row.captured_blocks, queries, hits)
            )
        return out


@dataclass(frozen=True, slots=True)
class Shares:
    """The decomposition of a set of rows as shares (None where there is nothing to divide)."""

    offered: float | None
    """Offered blocks over prompt blocks: the reuse the workload offered."""
    captured: float | None
    """Captured over offered: the routing's share."""
    delivered: float | None
    """The engine's hit ratio over the captured ratio: the engine's share."""
    engine_hit_ratio: float | None
    """The engine's hits over its queries."""


def shares(rows: list[ReuseRow]) -> Shares:
    """The shares of ``rows`` summed (one replica, a pool, or the whole fleet)."""
    prompt = sum(r.prompt_blocks for r in rows)
    offered = sum(r.offered_blocks for r in rows)
    captured = sum(r.captured_blocks for r in rows)
    reporting = [r for r in rows if r.engine_queries_tokens >= 0]
    queries = sum(r.engine_queries_tokens for r in reporting)
    hits = sum(r.engine_hits_tokens for r in reporting)
    engine = hits / queries if queries > 0 else None
    captured_ratio = captured / prompt if prompt else None
    return Shares(
        offered / prompt if prompt else None,
        captured / offered if offered else None,
        engine / captured_ratio if engine is not None and captured_ratio else None,
        engine,
    )
