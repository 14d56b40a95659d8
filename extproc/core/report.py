"""A decision told to whoever watches: the metrics, the reuse ledger, the decision feed, the log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from extproc.fleet.cache.reuse import ReuseLedger
from extproc.observe.decisions import DecisionFeed
from extproc.observe.metrics import RouterMetrics
from extproc.request.features import RequestFeatures
from extproc.routing.model import AffinityView, Decision

log = logging.getLogger("extproc.app.router")


@dataclass(frozen=True, slots=True)
class DecisionReport:
    """Where each decision is reported."""

    metrics: RouterMetrics
    reuse: ReuseLedger
    feed: DecisionFeed
    fleet_size: Callable[[], int]
    _counters: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)
    """``decisions``' child per (reason, model label): found once, not by ``labels()`` each decision
    (bounded: the model label is, and no child of it is ever removed)."""

    def decided(
        self, features: RequestFeatures, decision: Decision, view: AffinityView, start: float, now: float
    ) -> None:
        """The decision in the metrics, the decision feed and the debug log."""
        m = self.metrics
        key = (decision.reason.value, m.model_label(features.model or "none"))
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = m.decisions.labels(*key)
        counter.inc()
        m.decision_seconds.observe(now - start)
        if decision.pair is not None:
            m.disaggregated(
                decision.pair.value, decision.prefill.name if decision.prefill else None, decision.transfer_blocks
            )
        if decision.total_blocks:
            m.prefix_blocks.inc(decision.total_blocks)
            m.prefix_blocks_matched.inc(decision.matched_blocks)
            size = self.fleet_size()
            if view.prefix_matches and size:
                m.prefix_blocks_round_robin.inc(sum(view.prefix_matches.values()) / size)
            if decision.replica is not None:
                self.reuse.routed(
                    decision.replica.name, decision.total_blocks, view.prefix_matches, decision.matched_blocks
                )
        if self.feed.watched:
            self.feed.publish(decision, features.model, now - start)
        if log.isEnabledFor(logging.DEBUG):
            _log(features, decision, now - start)


def _log(features: RequestFeatures, decision: Decision, took_s: float) -> None:
    replica = decision.replica.name if decision.replica else None
    # Every candidate's total, best first: why the chosen one won, and by how much.
    scores = {name: round(value, 4) for name, value in sorted(decision.scores.items(), key=lambda kv: -kv[1])}
    log.debug(
        "decision request_id=%s replica=%s reason=%s matched=%d/%d moved_by=%s scores=%s",
        features.request_id,
        replica,
        decision.reason.value,
        decision.matched_blocks,
        decision.total_blocks,
        decision.moved_by or "-",
        ",".join(f"{name}:{value:g}" for name, value in scores.items()) or "-",
        extra={
            "event": "decision",
            "request_id": features.request_id,
            "replica": replica,
            "reason": decision.reason.value,
            "model": features.model,
            "matched_blocks": decision.matched_blocks,
            "total_blocks": decision.total_blocks,
            "moved_by": decision.moved_by,
            "scores": scores,
            "prefill": decision.prefill.name if decision.prefill else None,
            "pair": decision.pair.value if decision.pair else None,
            "stream": features.stream,
            "decision_ms": round(took_s * 1000, 3),
        },
    )
