"""The router facade: request features -> store view -> pure decision -> bookkeeping.

It knows no gRPC. The ext_proc servicer hands it headers and body bytes and gets back a
:class:`Routed` to translate into Envoy's language; the simulator drives the same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from extproc.config import Config
from extproc.metrics import RouterMetrics
from extproc.request.features import CHARS_PER_TOKEN, RequestFeatures, extract_features
from extproc.routing.model import AffinityView, Decision, Reason
from extproc.routing.pipeline import Profile, decide
from extproc.routing.registry import build_profile
from extproc.state.memory import MemoryStore
from extproc.state.replicas import ReplicaBook
from extproc.state.store import AffinityStore

log = logging.getLogger("extproc.router")

Clock = Callable[[], float]


@dataclass(slots=True)
class Routed:
    """One routed request: its features, the decision, and when it was made."""

    features: RequestFeatures
    decision: Decision
    decided_at: float
    prefill_tokens: int = 0
    released: bool = False


class Router:
    """Routes requests and learns from their outcomes."""

    def __init__(
        self,
        config: Config,
        store: AffinityStore | None = None,
        clock: Clock = time.monotonic,
        metrics: RouterMetrics | None = None,
        profile: Profile | None = None,
    ) -> None:
        self.config = config
        self.store: AffinityStore = store or MemoryStore(
            config.session_ttl_s, config.max_sessions, config.blocks_per_replica
        )
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.profile = profile or build_profile(
            config.profile, vnodes=config.vnodes, ring_key_blocks=config.ring_key_blocks
        )
        self.replicas = ReplicaBook(config.replicas, config.health)

    async def route(self, headers: Mapping[str, str], body: bytes | None) -> Routed:
        """Decide where a request goes and record the decision (pin, prefix index, in-flight)."""
        start = self.clock()
        features = extract_features(headers, body, self.config.features)
        if features.body_error is not None and body is not None:
            self.metrics.body_errors.inc()
        return await self.route_features(features, start)

    async def route_features(self, features: RequestFeatures, start: float | None = None) -> Routed:
        """:meth:`route` for a request already turned into features (the simulator's entry point)."""
        if start is None:
            start = self.clock()
        try:
            view = await self.store.lookup(features.session_key, features.prefix_hashes, start)
        except Exception as exc:  # the store is an optimisation: route on hashing without it
            self.metrics.store_errors.labels("lookup").inc()
            log.debug("store lookup failed: %s", exc)
            view = AffinityView()
        decision = decide(features, self.replicas.snapshot(start), view, start, self.profile)
        replica = decision.replica
        prefill_tokens = 0
        if replica is not None:
            prefill_tokens = self._uncached_tokens(features, decision.matched_blocks)
            self.replicas.begin(replica.name, start, prefill_tokens)
            pin = decision.reason != Reason.SPILLOVER or self.config.spillover_repin
            try:
                await self.store.record(features.session_key, replica.name, features.prefix_hashes, start, pin)
            except Exception as exc:
                self.metrics.store_errors.labels("record").inc()
                log.debug("store record failed: %s", exc)
        now = self.clock()
        m = self.metrics
        m.decisions.labels(decision.reason.value).inc()
        m.decision_seconds.observe(now - start)
        if decision.total_blocks:
            m.prefix_blocks.inc(decision.total_blocks)
            m.prefix_blocks_matched.inc(decision.matched_blocks)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision request_id=%s replica=%s reason=%s matched=%d/%d",
                features.request_id,
                replica.name if replica else None,
                decision.reason.value,
                decision.matched_blocks,
                decision.total_blocks,
            )
        return Routed(features, decision, now, prefill_tokens)

    def _uncached_tokens(self, features: RequestFeatures, matched_blocks: int) -> int:
        cached_chars = matched_blocks * self.config.features.block_chars
        return max(0, features.prompt_chars - cached_chars) // CHARS_PER_TOKEN

    def observe_response(self, routed: Routed, status: int) -> None:
        """Learn from the response headers Envoy saw: status and time to first byte."""
        replica = routed.decision.replica
        if replica is not None:
            now = self.clock()
            self.replicas.observe(replica.name, status, now - routed.decided_at, now)
            self.replicas.prefilled(replica.name, routed.prefill_tokens)
            routed.prefill_tokens = 0

    def release(self, routed: Routed) -> None:
        """The request is over (or abandoned): its in-flight slot is freed, once."""
        if routed.released or routed.decision.replica is None:
            return
        routed.released = True
        self.replicas.end(routed.decision.replica.name, routed.prefill_tokens)
        routed.prefill_tokens = 0

    def collect(self) -> None:
        """Refresh gauges from current state (called before each metrics scrape)."""
        m = self.metrics
        for rec in self.replicas.records():
            name = rec.replica.name
            m.replica_inflight.labels(name).set(rec.inflight)
            m.replica_health.labels(name).set(rec.health)
            m.replica_in_rotation.labels(name).set(1 if rec.rotation.in_rotation else 0)
            m.replica_queue.labels(name).set(rec.queue)
            m.replica_kv_usage.labels(name).set(rec.kv_usage)
        self.metrics.sessions.set(self.store.stats().sessions)
