"""What each replica's own /metrics page said, re-exported beside the router's estimate."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What the router last read from one replica's own /metrics page, re-exported."""

    replica: str
    prefix_hits_tokens: float | None
    prefix_queries_tokens: float | None
    last_scrape_unix: float | None


class ReplicaReportCollector(Collector):
    """Re-exports replica-reported counters (the real prefix-cache hit ratio needs them next to
    the router's estimate, also where Prometheus does not scrape the replicas itself) and the
    time of each replica's last good scrape (for a staleness alert)."""

    def __init__(self, rows: Callable[[], Sequence[ReplicaReport]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        """One family per signal, one sample per replica that reported it."""
        hits = CounterMetricFamily(
            "extproc_replica_prefix_cache_hits_tokens",
            "Prefix-cache hits in tokens, as the replica reports them (vllm:prefix_cache_hits_total).",
            labels=["replica"],
        )
        queries = CounterMetricFamily(
            "extproc_replica_prefix_cache_queries_tokens",
            "Prefix-cache queries in tokens, as the replica reports them (vllm:prefix_cache_queries_total).",
            labels=["replica"],
        )
        scraped = GaugeMetricFamily(
            "extproc_replica_last_scrape_timestamp_seconds",
            "Unix time of the last successful scrape of the replica's /metrics page.",
            labels=["replica"],
        )
        for row in self.rows():
            if row.prefix_hits_tokens is not None and row.prefix_queries_tokens is not None:
                hits.add_metric([row.replica], row.prefix_hits_tokens)
                queries.add_metric([row.replica], row.prefix_queries_tokens)
            if row.last_scrape_unix is not None:
                scraped.add_metric([row.replica], row.last_scrape_unix)
        yield from (hits, queries, scraped)
