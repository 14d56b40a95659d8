"""The router facade: request features -> store view -> pure decision -> bookkeeping.

It knows no gRPC. The ext_proc servicer hands it headers and body bytes and gets back a
:class:`Routed` to translate into Envoy's language; the simulator drives the same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from extproc.config import Config
from extproc.metrics import ReplicaReport, ReplicaReportCollector, RouterMetrics
from extproc.rebalance.rebalancer import Rebalancer
from extproc.request.features import CHARS_PER_TOKEN, RequestFeatures, extract_features
from extproc.routing.model import AffinityView, Decision, Reason, Replica
from extproc.routing.pipeline import Profile, decide
from extproc.routing.plugins import TenantShardFilter
from extproc.routing.registry import build_profile
from extproc.state.cache_estimate import CacheEstimate
from extproc.state.memory import MemoryStore
from extproc.state.replicas import ReplicaBook, Transition
from extproc.state.store import AffinityStore
from extproc.tenancy import TenantLedger

log = logging.getLogger("extproc.router")

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Membership:
    """What a membership update changed."""

    joined: tuple[str, ...]
    left: tuple[str, ...]


@dataclass(slots=True)
class Routed:
    """One routed request: its features, the decision, and when it was made."""

    features: RequestFeatures
    decision: Decision
    decided_at: float
    prefill_tokens: int = 0
    released: bool = False
    tenant_counted: bool = False
    retry_after_s: int | None = None
    kv_tokens: int = 0
    """KV tokens the request was counted as holding on its replica while in flight."""


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
        self._sampled = 0.0  # response_sample_rate accumulated: a request is observed at each whole one
        self.store: AffinityStore = store or MemoryStore(
            config.session_ttl_s, config.max_sessions, config.blocks_per_replica
        )
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.profile = profile or build_profile(
            config.profile, vnodes=config.vnodes, ring_key_blocks=config.ring_key_blocks
        )
        self.profiles = {
            name: build_profile(spec, vnodes=config.vnodes, ring_key_blocks=config.ring_key_blocks)
            for name, spec in config.profiles.items()
        }
        self.tenants = TenantLedger(config.tenants)
        shard_sizes = {name: p.shard_size for name, p in config.tenants.definitions.items() if p.shard_size}
        for profile_ in (self.profile, *self.profiles.values()):
            for flt in profile_.filters:
                if isinstance(flt, TenantShardFilter) and not flt.shard_sizes:
                    flt.shard_sizes = shard_sizes
        self.replicas = ReplicaBook(config.replicas, config.health)
        # Capacity and trust of the prefix index per replica, from the replicas' own metrics.
        self.cache_estimate = CacheEstimate(config.features.block_chars // CHARS_PER_TOKEN)
        self.metrics.registry.register(ReplicaReportCollector(self._replica_reports))
        self.rebalancer = Rebalancer(
            config.rebalance,
            self.store,
            clock,
            self.metrics,
            self._index_hashes,
            session_ttl_s=config.session_ttl_s,
        )

    async def route(self, headers: Mapping[str, str], body: bytes | None) -> Routed:
        """Decide where a request goes and record the decision (pin, prefix index, in-flight)."""
        start = self.clock()
        features = extract_features(headers, body, self.config.features)
        if features.body_error is not None and body is not None:
            self.metrics.body_errors.inc()
        routed = await self.route_features(features, start)
        replica = routed.decision.replica
        if features.session_key and body and replica is not None and features.body_error is None:
            self.rebalancer.note(features.session_key, features.model, replica.name, features.path, body, start)
        return routed

    def _index_hashes(self, path: str, body: bytes) -> tuple[int, ...]:
        return extract_features({":path": path}, body, self.config.features).prefix_hashes

    async def route_features(self, features: RequestFeatures, start: float | None = None) -> Routed:
        """:meth:`route` for a request already turned into features (the simulator's entry point)."""
        if start is None:
            start = self.clock()
        try:
            view = await self.store.lookup(features.session_key, features.prefix_hashes, start, model=features.model)
        except Exception as exc:  # the store is an optimisation: route on hashing without it
            self.metrics.store_errors.labels("lookup").inc()
            log.debug("store lookup failed: %s", exc)
            view = AffinityView()
        self.cache_estimate.sync(self.replicas, self.store)
        claims, view = view.prefix_matches, self.cache_estimate.adjust(view)
        policy = self.tenants.policy(features.tenant)
        tenant_counted = rejected = False
        if policy is not None and self.tenants.over_quota(features.tenant, len(self.replicas)):
            if policy.over_quota == "overflow":
                features = replace(features, pool=tuple(sorted(self.config.tenants.overflow_pool.items())))
            else:
                rejected = True
        if rejected:
            decision = Decision(replica=None, reason=Reason.QUOTA)
        else:
            profile = self.profiles.get(features.profile or "", self.profile)
            snapshot = self.replicas.snapshot(start, self.tenants.by_replica)
            decision = decide(features, snapshot, view, start, profile)
        replica = decision.replica
        prefill_tokens = 0
        if replica is not None:
            prefill_tokens = self._uncached_tokens(features, decision.matched_blocks)
            raw_uncached = self._uncached_tokens(features, claims.get(replica.name, 0))
            self.cache_estimate.claimed(replica.name, features.prompt_chars // CHARS_PER_TOKEN - raw_uncached)
            # What it adds to the replica's KV: the part not believed cached (a shared prefix is held
            # once, however many requests use it).
            self.replicas.begin(replica.name, start, prefill_tokens, prefill_tokens)
            tenant_counted = self.tenants.begin(features.tenant, replica.name)
            pin = decision.reason != Reason.SPILLOVER or self.config.spillover_repin
            try:
                await self.store.record(
                    features.session_key, replica.name, features.prefix_hashes, start, pin, model=features.model
                )
            except Exception as exc:
                self.metrics.store_errors.labels("record").inc()
                log.debug("store record failed: %s", exc)
        now = self.clock()
        m = self.metrics
        m.decisions.labels(decision.reason.value, m.model_label(features.model or "none")).inc()
        m.decision_seconds.observe(now - start)
        if decision.total_blocks:
            m.prefix_blocks.inc(decision.total_blocks)
            m.prefix_blocks_matched.inc(decision.matched_blocks)
            if view.prefix_matches and len(self.replicas):
                m.prefix_blocks_round_robin.inc(sum(view.prefix_matches.values()) / len(self.replicas))
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision request_id=%s replica=%s reason=%s matched=%d/%d",
                features.request_id,
                replica.name if replica else None,
                decision.reason.value,
                decision.matched_blocks,
                decision.total_blocks,
                extra={
                    "event": "decision",
                    "request_id": features.request_id,
                    "replica": replica.name if replica else None,
                    "reason": decision.reason.value,
                    "model": features.model,
                    "matched_blocks": decision.matched_blocks,
                    "total_blocks": decision.total_blocks,
                    "stream": features.stream,
                    "decision_ms": round((now - start) * 1000, 3),
                },
            )
        retry_after = policy.retry_after_s if policy is not None and decision.reason is Reason.QUOTA else None
        return Routed(
            features,
            decision,
            now,
            prefill_tokens,
            tenant_counted=tenant_counted,
            retry_after_s=retry_after,
            kv_tokens=prefill_tokens,
        )

    def _uncached_tokens(self, features: RequestFeatures, matched_blocks: int) -> int:
        cached_chars = matched_blocks * self.config.features.block_chars
        return max(0, features.prompt_chars - cached_chars) // CHARS_PER_TOKEN

    def sample_response(self) -> bool:
        """Whether to observe the next request's response headers (``health.response_sample_rate``).

        Deterministic: with a rate of 0.25 exactly every fourth request is observed. A request that
        is not observed keeps its in-flight slot until its stream ends (Envoy holds the ext_proc
        stream open until the HTTP request is over) and its prefill counts as pending until then.
        """
        rate = self.config.health.response_sample_rate
        if rate >= 1.0:
            return True
        self._sampled += rate
        if self._sampled >= 1.0:
            self._sampled -= 1.0
            return True
        return False

    def observe_response(self, routed: Routed, status: int) -> None:
        """Learn from the response headers Envoy saw: status and time to first byte."""
        replica = routed.decision.replica
        self.metrics.responses_observed.inc()
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
        self.replicas.end(routed.decision.replica.name, routed.prefill_tokens, routed.kv_tokens)
        if routed.tenant_counted:
            self.tenants.end(routed.features.tenant, routed.decision.replica.name)
        routed.prefill_tokens = 0

    async def set_replicas(self, replicas: Sequence[Replica]) -> Membership:
        """Make ``replicas`` the membership (from discovery or a reload): new names join and take
        their ring share of live sessions (pre-warmed), missing names leave and their sessions move
        to their next ring replica, known names take the new address and weight."""
        wanted = {r.name: r for r in replicas}
        joined = [r.name for r in replicas if self.replicas.join(r)]
        left = [rec.replica.name for rec in self.replicas.records() if rec.replica.name not in wanted]
        now = self.clock()
        for name in left:
            snapshot = self.replicas.snapshot(now)
            await self.rebalancer.on_leave(name, self.profile.ring_for(snapshot), snapshot)
            self.replicas.leave(name)
            try:
                await self.store.forget_replica(name)
            except Exception as exc:
                self.metrics.store_errors.labels("forget").inc()
                log.debug("store forget failed: %s", exc)
        snapshot = self.replicas.snapshot(now)
        for name in joined:
            await self.rebalancer.on_join(name, self.profile.ring_for(snapshot), snapshot)
        if joined or left:
            log.info("membership: joined %s, left %s", joined or "-", left or "-")
        return Membership(tuple(joined), tuple(left))

    async def after_scrape(self, transitions: Sequence[Transition]) -> None:
        """After each health round: move the sessions of replicas that left the rotation, and shed
        sessions from replicas that have run hot for a while."""
        snapshot = self.replicas.snapshot(self.clock())
        for t in transitions:
            if not t.in_rotation:
                await self.rebalancer.on_leave(t.replica, self.profile.ring_for(snapshot), snapshot)
        await self.rebalancer.check_hot(snapshot)

    def _replica_reports(self) -> list[ReplicaReport]:
        # The router's clock is monotonic; the exported timestamp must be wall time.
        offset = time.time() - self.clock()
        rows = []
        for rec in self.replicas.records():
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

    def collect(self) -> None:
        """Refresh gauges from current state (called before each metrics scrape)."""
        m = self.metrics
        for rec in self.replicas.records():
            name = rec.replica.name
            m.replica_seen(name)
            m.replica_inflight.labels(name).set(rec.inflight)
            m.replica_health.labels(name).set(rec.health)
            m.replica_in_rotation.labels(name).set(1 if rec.rotation.in_rotation else 0)
            m.replica_queue.labels(name).set(rec.queue)
            m.replica_kv_usage.labels(name).set(rec.kv_usage)
        stats = self.store.stats()
        m.sessions.set(stats.sessions)
        m.prefix_index_blocks.set(stats.prefix_blocks)
        m.ledger_sessions.set(len(self.rebalancer.ledger))
        m.ledger_bytes.set(self.rebalancer.ledger.size_bytes)
