"""The fleet as an operator sees it: one row per replica, for ListReplicas and the console."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from extproc.app.router import Router
from extproc.fleet.health.score import penalties
from extproc.fleet.kvevents.feed import KvEventSource


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica's state, plain values only (no session key, no request content)."""

    name: str
    address: str
    health: float
    health_penalties: dict[str, float] = field(default_factory=dict)
    in_rotation: bool = True
    rotation_state: str = "in rotation"
    cordon: str = ""
    inflight: int = 0
    queue: int = 0
    kv_usage: float = 0.0
    sessions_pinned: int = 0
    kv_events: str = "none"
    pending_prefill_tokens: int = 0
    scrape_failures: int = 0
    cache_trust: float = 1.0
    role: str = "both"
    """Its part in disaggregated serving (``llm-d.ai/role``): prefill, decode or both."""


def fleet(router: Router) -> list[ReplicaRow]:
    """Every replica the router knows, in name order."""
    now = router.clock()
    pinned = Counter(e.replica for e in router.rebalancer.ledger.live(now))
    limits = router.replicas.settings.limits
    feeds = router.kv_events.source if router.kv_events is not None else None
    rows = []
    for rec in sorted(router.replicas.records(), key=lambda r: r.replica.name):
        name = rec.replica.name
        rotation = rec.rotation
        state = "in rotation" if rotation.in_rotation else f"ejected ({rotation.ejections}x)"
        rows.append(
            ReplicaRow(
                name=name,
                address=rec.replica.address,
                health=round(rec.health, 4),
                health_penalties={
                    k: round(v, 4) for k, v in penalties(router.replicas.signals(rec, now), limits).items()
                },
                in_rotation=rotation.in_rotation,
                rotation_state=state,
                cordon=router.cordons.get(name, ""),
                inflight=rec.inflight,
                queue=rec.queue,
                kv_usage=round(rec.kv_usage, 4),
                sessions_pinned=pinned.get(name, 0),
                pending_prefill_tokens=rec.pending_prefill_tokens,
                scrape_failures=rec.scrape_failures,
                kv_events=_feed_state(feeds, name, now),
                cache_trust=round(router.caches.estimate.trust(name), 4),
                role=rec.replica.role.value,
            )
        )
    return rows


def _feed_state(source: KvEventSource | None, replica: str, now: float) -> str:
    """The replica's KV-event stream: none, connecting (no message yet), live, stale, or
    suspended (it speaks, but cannot be right: ``suspended (block_size)``, ``(predictions)``...)."""
    feed = source.feeds.get(replica) if source is not None else None
    if source is None or feed is None:
        return "none"
    if source.is_live(replica, now):
        return "live"
    causes = source.suspended.get(replica)
    if causes and source.speaks(replica, now):
        return f"suspended ({', '.join(sorted(causes))})"
    return "stale" if feed.synced else "connecting"
