"""The hit ratio decomposed, as counters: the reuse offered, the share captured, what the engine
delivered (:mod:`extproc.fleet.cache.reuse` says what each is), per pool and replica."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

BLOCK_KINDS = ("prompt", "offered", "captured")
ENGINE_KINDS = ("queries", "hits")


class ReuseReport(NamedTuple):
    """One replica's account since the router started."""

    pool: str
    replica: str
    prompt_blocks: int
    offered_blocks: int
    captured_blocks: int
    engine_queries_tokens: float
    """-1 when the engine reports no prefix-cache counters."""
    engine_hits_tokens: float


class ReuseCollector(Collector):
    """``extproc_reuse_blocks_total{pool, replica, kind}`` (prompt, offered, captured: the router's
    prefix blocks) and ``extproc_reuse_engine_tokens_total{pool, replica, kind}`` (queries, hits:
    the engine's own counters since the router started)."""

    def __init__(self, rows: Callable[[], Sequence[ReuseReport]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        """Both families, a sample per replica and kind (the engine's only where it reports)."""
        blocks = CounterMetricFamily(
            "extproc_reuse_blocks",
            "Prefix blocks of the prompts routed to a replica, by kind: prompt (all of them), offered (the most "
            "any replica of its pool was believed to hold), captured (what the chosen replica was believed to hold).",
            labels=["pool", "replica", "kind"],
        )
        engine = CounterMetricFamily(
            "extproc_reuse_engine_tokens",
            "The engine's own prefix-cache counters since the router started, by kind: queries and hits "
            "(vllm:prefix_cache_queries_total / hits_total); every gateway reports the same engine's.",
            labels=["pool", "replica", "kind"],
        )
        for row in self.rows():
            for kind, value in zip(BLOCK_KINDS, row[2:5], strict=True):
                blocks.add_metric([row.pool, row.replica, kind], value)
            if row.engine_queries_tokens >= 0:
                engine.add_metric([row.pool, row.replica, "queries"], row.engine_queries_tokens)
                engine.add_metric([row.pool, row.replica, "hits"], row.engine_hits_tokens)
        yield from (blocks, engine)
