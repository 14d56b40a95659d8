"""The router's state as metrics: gauges refreshed before each scrape, and the prefix-cache
counters each replica last reported, with the time of that report.

Kept apart from the router so that the facade wires and decides, and what is exported is
decided here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import astuple

from extproc.app.router import Router
from extproc.fleet.cache.reuse import ReuseRow
from extproc.fleet.health.replicas import Transition
from extproc.observe.metrics import ReplicaReport, ReplicaReportCollector
from extproc.observe.metrics.reuse import ReuseCollector, ReuseReport

CORDON_GAUGE = {"cordoned": 1, "drained": 2}
ERROR_QUANTILES = (0.5, 0.9)


def export(router: Router) -> Callable[[], None]:
    """Register the router's per-replica report collectors on its registry; returns the function
    that refreshes the gauges, to call before each scrape."""
    router.metrics.registry.register(ReplicaReportCollector(lambda: replica_reports(router)))
    router.metrics.registry.register(ReuseCollector(lambda: [ReuseReport(*astuple(r)) for r in reuse_rows(router)]))
    return lambda: collect(router)


def read_engines(router: Router) -> None:
    """Hand the hit-ratio ledger each engine's prefix-cache counters as last scraped."""
    for rec in router.replicas.records():
        m = rec.metrics
        if m is not None:
            router.reuse.engine_read(rec.replica.name, m.prefix_hits, m.prefix_queries)


def after_scrape(router: Router) -> Callable[[list[Transition]], Awaitable[None]]:
    """The scraper's listener: the engines' counters read into the hit-ratio ledger from the first
    scrape on (what they counted before is not the router's), then the router's own."""

    async def listener(transitions: list[Transition]) -> None:
        read_engines(router)
        await router.fleet.after_scrape(transitions)

    return listener


def reuse_rows(router: Router) -> list[ReuseRow]:
    """The hit ratio decomposed per replica (:mod:`extproc.fleet.cache.reuse`), the engines' counters
    as last scraped."""
    read_engines(router)
    return router.reuse.rows([rec.replica.name for rec in router.replicas.records()])


def replica_reports(router: Router) -> list[ReplicaReport]:
    """Each replica's prefix-cache counters as last scraped, stamped with wall time."""
    # The router's clock is monotonic; the exported timestamp must be wall time.
    offset = router.world.wall() - router.clock()
    rows = []
    for rec in router.replicas.records():
        m = rec.metrics
        scraped = rec.scraped_at + offset if rec.scraped_at != float("-inf") and m is not None else None
        rows.append(
            ReplicaReport(
                rec.replica.name,
                m.prefix_hits if m is not None else None,
                m.prefix_queries if m is not None else None,
                scraped,
            )
        )
    return rows


def collect(router: Router) -> None:
    """Refresh the gauges from the router's current state."""
    m = router.metrics
    now = router.clock()
    pinned = Counter(e.replica for e in router.rebalancer.ledger.live(now))
    m.latency_prediction_error.clear()  # members only, and only models that have predicted
    for rec in router.replicas.records():
        name = rec.replica.name
        m.replica_seen(name)
        m.replica_inflight.labels(name).set(rec.inflight)
        m.replica_health.labels(name).set(rec.health)
        m.replica_in_rotation.labels(name).set(1 if rec.rotation.in_rotation else 0)
        m.replica_queue.labels(name).set(rec.queue)
        m.replica_kv_usage.labels(name).set(rec.kv_usage)
        m.replica_cache_fill.labels(name).set(rec.cache_fill)
        m.replica_cache_trust.labels(name).set(router.caches.estimate.trust(name))
        age = router.caches.estimate.evidence_age(name, now)
        m.replica_cache_evidence_age.labels(name).set(-1.0 if age is None else age)
        m.replica_sessions.labels(name).set(pinned.get(name, 0))
        m.replica_cordon.labels(name).set(CORDON_GAUGE.get(router.cordons.get(name, ""), 0))
        rates = router.rates.rates(name, rec.replica.labels)
        m.engine_prefill_rate.labels(name).set(rates.prefill_tokens_per_s)
        m.engine_decode_step.labels(name).set(rates.decode_step_s)
        for latency, values in router.latency.error_quantiles(name, ERROR_QUANTILES).items():
            for q, value in zip(ERROR_QUANTILES, values, strict=True):
                m.latency_prediction_error.labels(name, latency, f"{q:g}").set(value)
    stats = router.store.stats()
    m.sessions.set(stats.sessions)
    m.prefix_index_blocks.set(stats.prefix_blocks)
    m.ledger_sessions.set(len(router.rebalancer.ledger))
    m.ledger_bytes.set(router.rebalancer.ledger.size_bytes)
    if router.hot_keys is not None:
        m.hot_key_rate.clear()
        m.hot_key_replicas.clear()
        for hot in router.hot_keys.hot().values():
            m.hot_key_rate.labels(hot.label).set(hot.rate_rps)
            m.hot_key_replicas.labels(hot.label).set(hot.replicas)
    if router.kv_events is not None:
        hits = {r.replica.name: r.metrics.prefix_hits for r in router.replicas.records() if r.metrics is not None}
        router.kv_events.collect(hits)
