"""The router facade: request features -> store view -> pure decision -> bookkeeping.

It knows no gRPC. The ext_proc servicer hands it headers and body bytes and gets back a
:class:`Routed` to translate into Envoy's language; the simulator drives the same object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from extproc.cache_estimate import CacheEstimate
from extproc.config import Config
from extproc.decisions import DecisionFeed
from extproc.health.replicas import ReplicaBook, Transition
from extproc.hotkeys.detector import HotKeyDetector, label
from extproc.inflight_prefixes import InflightPrefixes, longer
from extproc.metrics import RouterMetrics
from extproc.queueing import FairQueue, Refusal, saturated
from extproc.rebalance.prewarm import Prewarmer
from extproc.rebalance.rebalancer import Rebalancer
from extproc.request.features import CHARS_PER_TOKEN, RequestFeatures, extract_features
from extproc.request.openai_body import INFERENCE_PATHS
from extproc.request.splits import Arm, body_user, choose_arm, rewrite_model
from extproc.routing.hot import fingerprint
from extproc.routing.model import AffinityView, Decision, Reason, Replica, Snapshot
from extproc.routing.pipeline import Decider, Profile, Profiles, decide
from extproc.routing.registry import build_profile
from extproc.routing.trace import DecisionTrace, Explanation
from extproc.sampling import RateSampler
from extproc.state.memory import MemoryStore
from extproc.state.store import AffinityStore
from extproc.tenancy import TenantLedger

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.kvevents.cache_state import EventCacheState

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
    arm: Arm | None = None
    """The split arm the request landed in, if a ``splits:`` rule took it."""
    body: bytes | None = None
    """The body rewritten for its arm (its model replaced), to send instead of the client's."""
    refusal: Refusal | None = None
    """Held while the fleet was full and refused (queue full, or waited past its class's limit)."""
    kv_tokens: int = 0
    """KV tokens the request was counted as holding on its replica while in flight."""
    claimed_tokens: int = 0
    """Prompt tokens the prefix index claimed cached on the chosen replica (before trust), handed to
    the cache estimate once the prefill is done: the replica counts its hits when it prefills,
    and behind a queue that is seconds after the decision."""
    sent_tokens: int = 0
    """The prompt's tokens, handed to the cache estimate with the claim: the share of them the
    replica's query counter covers says how much of the claim its hits bear on."""


def _with_inflight(view: AffinityView, inflight: Mapping[str, int]) -> AffinityView:
    """The view with each replica's match at least what the router's requests in flight there
    cover: those it runs or has queued prefill their prompts before a request sent now (not scaled
    by trust: the replica's counters judge the index, not this)."""
    matches = longer(view.prefix_matches, inflight)
    return view if matches is view.prefix_matches else replace(view, prefix_matches=matches)


def build_profiles(config: Config, default: Profile | None = None) -> Profiles:
    """The config's profiles (its default one replaced by ``default`` when given), with its ring
    and re-pin settings."""
    options: dict[str, Any] = {
        "vnodes": config.ring.vnodes,
        "ring_key_blocks": config.ring.key_blocks,
        "repin_on_spillover": config.spillover.repin,
    }
    named = {name: build_profile(spec, **options) for name, spec in config.profiles.items()}
    return Profiles(default or build_profile(config.profile, **options), named)


class Router:
    """Routes requests and learns from their outcomes."""

    def __init__(
        self,
        config: Config,
        store: AffinityStore | None = None,
        clock: Clock = time.monotonic,
        metrics: RouterMetrics | None = None,
        profile: Profile | None = None,
        *,
        replicas: ReplicaBook | None = None,
        tenants: TenantLedger | None = None,
        prewarmer: Prewarmer | None = None,
        kv_events: EventCacheState | None = None,
        decider: Decider = decide,
        hot_keys: HotKeyDetector | None = None,
    ) -> None:
        """Wire the collaborators: each is built from ``config`` unless given (tests and the
        simulator give their own store, clock, default profile or pre-warmer; the simulator's
        peer routers their own ``decider``)."""
        self.config = config
        self.decide = decider
        self.kv_events = kv_events  # vLLM's KV events: where a replica's feed is live, its matches
        self._responses = RateSampler()  # health.response_sample_rate
        self.store: AffinityStore = store or MemoryStore(
            config.sessions.ttl_s, config.sessions.max_sessions, config.prefix.blocks_per_replica
        )
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.profiles = build_profiles(config, profile)
        self.tenants = tenants or TenantLedger(config.tenants)
        self.replicas = replicas or ReplicaBook(config.replicas, config.health)
        # Capacity and trust of the prefix index per replica, from the replicas' own metrics.
        self.cache_estimate = CacheEstimate(config.features.block_chars // CHARS_PER_TOKEN)
        # Prompts in flight per replica: prefixes a replica will hold when a request sent now runs.
        self.inflight_prefixes = InflightPrefixes()
        self.queue: FairQueue | None = None
        if config.queueing.enabled:
            self.queue = FairQueue(config.queueing, self.fleet_saturated, self.metrics)
        self.rebalancer = Rebalancer(
            config.rebalance,
            self.store,
            clock,
            self.metrics,
            self._index_hashes,
            prewarmer,
            session_ttl_s=config.sessions.ttl_s,
        )
        self.cordons: dict[str, str] = {}  # the store's cordons as last read (refresh_cordons)
        self.feed = DecisionFeed()  # WatchDecisions and the console; costs nothing unwatched
        # Hot prefixes (``hot_keys:``): sampled fingerprints; the decision is given the hot table.
        self.hot_keys = hot_keys
        if self.hot_keys is None and config.hot_keys.enabled:
            self.hot_keys = HotKeyDetector(config.hot_keys, now=clock())

    @property
    def profile(self) -> Profile:
        """The default profile (request classes may choose others: :attr:`profiles`)."""
        return self.profiles.default

    async def route(self, headers: Mapping[str, str], body: bytes | None) -> Routed:
        """Decide where a request goes and record the decision (pin, prefix index, in-flight)."""
        start = self.clock()
        features = extract_features(headers, body, self.config.features)
        if features.body_error is not None and body is not None:
            self.metrics.body_errors.inc()
        arm, rewritten = None, None
        if self.config.splits and body is not None and features.body_error is None:
            features, arm, rewritten = self._split(headers, body, features)
            if rewritten is not None:
                body = rewritten
        if self.kv_events is not None:
            features = await self.kv_events.tokenized(features, body)
        ticket = None
        if self.queue is not None and features.path in INFERENCE_PATHS:  # /v1/models is never held
            held = await self.queue.admit(features.request_class, features.tenant, features.pool)
            if isinstance(held, Refusal):
                return Routed(features, Decision(None, Reason.NO_REPLICA), self.clock(), arm=arm, refusal=held)
            ticket = held
            start = self.clock()  # the decision is made now, on the load as it is now
        try:
            routed = await self.route_features(features, start)
        finally:
            if ticket is not None:
                ticket.settle()
        routed.arm, routed.body = arm, rewritten
        if arm is not None:
            self.metrics.split_requests.labels(arm.rule, arm.label).inc()
        replica = routed.decision.replica
        if self.hot_keys is not None and body and features.body_error is None:
            self.offer_hot_body(features, body)
        if features.session_key and body and replica is not None and features.body_error is None:
            self.rebalancer.note(features.session_key, features.model, replica.name, features.path, body, start)
        return routed

    def _split(
        self, headers: Mapping[str, str], body: bytes, features: RequestFeatures
    ) -> tuple[RequestFeatures, Arm | None, bytes | None]:
        """The request's split arm; its body rewritten to the arm's model and its features taken
        again from that body, so the prefix hashes are seeded with the model actually served."""
        key = features.session_key or body_user(body) or features.request_id or None
        arm = choose_arm(self.config.splits, features.model, headers, key)
        if arm is None:
            return features, None, None
        rewritten = None
        if arm.target.model != features.model:
            rewritten = rewrite_model(body, arm.target.model)
            if rewritten is not None:
                features = extract_features(headers, rewritten, self.config.features)
        if arm.target.pool is not None:
            features = replace(features, pool=(("pool", arm.target.pool),))
        return features, arm, rewritten

    def offer_hot_body(self, features: RequestFeatures, body: bytes | Callable[[], bytes]) -> None:
        """Keep a request of a hot prefix (one per hot key) to warm joining replicas with; ``body``
        may be a function that builds it, called only when one is wanted."""
        if self.hot_keys is None:
            return
        key = self.profiles.for_request(features).prefix_key(features)
        if key is None:
            return
        fp = fingerprint(key)
        if self.hot_keys.wants_exemplar(fp):
            self.hot_keys.keep_exemplar(fp, features.path, body() if callable(body) else body)

    def fleet_saturated(self, pool: tuple[tuple[str, str], ...]) -> bool:
        """Whether every candidate of ``pool`` is saturated now (``queueing:`` thresholds)."""
        return saturated(self.replicas.snapshot(self.clock()), pool, self.config.queueing)

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
        self.cache_estimate.sync(self.replicas, self.store, start)
        hashes = features.prefix_hashes
        inflight = self.inflight_prefixes.matches(hashes)
        claims = longer(view.prefix_matches, inflight)
        view = _with_inflight(self.cache_estimate.adjust(view), inflight)
        if self.kv_events is not None:
            view = self.kv_events.view(view, features, [r.replica.name for r in self.replicas.records()], start)
        view = self.cache_estimate.judge_pin(view, len(hashes))
        terms = self.tenants.terms(features.tenant, len(self.replicas))
        snapshot = self.replicas.snapshot(start, self.tenants.by_replica)
        profile = self.profiles.for_request(features)
        hot = None
        if self.hot_keys is not None:
            self.hot_keys.observe(profile.prefix_key(features), features.prompt_chars // CHARS_PER_TOKEN, start)
            hot = self.hot_keys.table()
        decision = self.decide(features, snapshot, view, start, profile, terms, cordons=self.cordons, hot=hot)
        replica = decision.replica
        if decision.hot_set and replica is not None:
            self._warm_hot_members(profile.prefix_key(features), decision, features, view)
        prefill_tokens = claimed_tokens = sent_tokens = 0
        tenant_counted = False
        if replica is not None:
            prefill_tokens = self._uncached_tokens(features, decision.matched_blocks)
            raw_uncached = self._uncached_tokens(features, claims.get(replica.name, 0))
            sent_tokens = features.estimated_prompt_tokens
            claimed_tokens = sent_tokens - raw_uncached
            # What it adds to the replica's KV: the part not believed cached (a shared prefix is held
            # once, however many requests use it).
            self.replicas.begin(replica.name, start, prefill_tokens, prefill_tokens)
            self.inflight_prefixes.add(replica.name, hashes)
            if self.kv_events is not None:
                self.kv_events.decided(features, replica.name, decision.matched_blocks, start)
            tenant_counted = self.tenants.begin(features.tenant, replica.name)
            try:
                await self.store.record(
                    features.session_key,
                    replica.name,
                    features.prefix_hashes,
                    start,
                    decision.pin,
                    model=features.model,
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
        if self.feed.watched:
            self.feed.publish(decision, features.model, now - start)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision request_id=%s replica=%s reason=%s matched=%d/%d moved_by=%s",
                features.request_id,
                replica.name if replica else None,
                decision.reason.value,
                decision.matched_blocks,
                decision.total_blocks,
                decision.moved_by or "-",
                extra={
                    "event": "decision",
                    "request_id": features.request_id,
                    "replica": replica.name if replica else None,
                    "reason": decision.reason.value,
                    "model": features.model,
                    "matched_blocks": decision.matched_blocks,
                    "total_blocks": decision.total_blocks,
                    "moved_by": decision.moved_by,
                    "stream": features.stream,
                    "decision_ms": round((now - start) * 1000, 3),
                },
            )
        return Routed(
            features,
            decision,
            now,
            prefill_tokens,
            tenant_counted=tenant_counted,
            kv_tokens=prefill_tokens,
            claimed_tokens=claimed_tokens,
            sent_tokens=sent_tokens,
        )

    async def explain(self, headers: Mapping[str, str], body: bytes | None) -> Explanation:
        """The decision :meth:`route` would make for this request now, with its trace, and
        without side effects: nothing is pinned, counted, indexed or refreshed."""
        now = self.clock()
        features = extract_features(headers, body, self.config.features)
        if self.kv_events is not None:  # the prompt's blocks as route() hashes them (a memo, no state)
            features = await self.kv_events.tokenized(features, body)
        try:
            view = await self.store.peek(features.session_key, features.prefix_hashes, now, model=features.model)
        except Exception as exc:  # as route(): without the store, the decision hashes
            log.debug("store peek failed: %s", exc)
            view = AffinityView()
        members = [r.replica.name for r in self.replicas.records()]
        # As route() weighs the estimate (without syncing it) and adds the prompts in flight.
        adjusted = self.cache_estimate.adjust(view)
        estimate = adjusted.prefix_matches
        view = _with_inflight(adjusted, self.inflight_prefixes.matches(features.prefix_hashes))
        sources = {r: "estimate" if estimate.get(r, 0) >= n else "in_flight" for r, n in view.prefix_matches.items()}
        if self.kv_events is not None:
            view = self.kv_events.view(view, features, members, now)
            if features.tokens_per_block and features.prefix_hashes:
                live = set(self.kv_events.source.live(members, now))
                sources = {r: "kv_events" if r in live else sources.get(r, "estimate") for r in view.prefix_matches}
        view = self.cache_estimate.judge_pin(view, len(features.prefix_hashes))
        trace = DecisionTrace()
        snapshot = self.replicas.snapshot(now, self.tenants.by_replica)
        terms = self.tenants.terms(features.tenant, len(self.replicas))
        profile = self.profiles.for_request(features)
        hot = self.hot_keys.table() if self.hot_keys is not None else None
        decision = self.decide(
            features, snapshot, view, now, profile, terms, cordons=self.cordons, trace=trace, hot=hot
        )
        uncached = {
            s.name: self._uncached_tokens(features, view.prefix_matches.get(s.name, 0)) for s in snapshot.replicas
        }
        return Explanation(features, decision, trace, view, snapshot, uncached, dict(self.cordons), sources)

    async def refresh_cordons(self) -> dict[str, str]:
        """Read the cordons from the store (every gateway's, with Redis). A replica newly drained
        elsewhere has the sessions this gateway knows moved off it here too."""
        try:
            found = await self.store.cordons()
        except Exception as exc:
            self.metrics.store_errors.labels("lookup").inc()
            log.debug("reading cordons failed: %s", exc)
            return self.cordons
        newly_drained = [n for n, s in found.items() if s == "drained" and self.cordons.get(n) != "drained"]
        self.cordons = found
        for name in newly_drained:
            await self._move_sessions_off(name)
        return found

    async def set_cordon(self, name: str, state: str | None) -> int:
        """Cordon (``"cordoned"``), drain (``"drained"``) or release (None) replica ``name`` for
        every gateway of the store; returns how many sessions a drain moved from this gateway."""
        await self.store.set_cordon(name, state)
        drained = state == "drained" and self.cordons.get(name) != "drained"
        cordons = dict(self.cordons)
        if state is None:
            cordons.pop(name, None)
        else:
            cordons[name] = state
        self.cordons = cordons
        log.info("replica %s: %s", name, state or "uncordoned")
        return await self._move_sessions_off(name) if drained else 0

    async def _move_sessions_off(self, name: str) -> int:
        now = self.clock()
        full = self.replicas.snapshot(now)
        # Moves land on replicas open to new sessions only.
        open_ = Snapshot(tuple(s for s in full.replicas if s.name == name or s.name not in self.cordons))
        return await self.rebalancer.on_leave(name, self.profile.ring_for(full), open_)

    def _uncached_tokens(self, features: RequestFeatures, matched_blocks: int) -> int:
        if features.tokens_per_block:
            return max(0, features.prompt_tokens - matched_blocks * features.tokens_per_block)
        cached_chars = matched_blocks * self.config.features.block_chars
        return max(0, features.prompt_chars - cached_chars) // CHARS_PER_TOKEN

    def sample_response(self) -> bool:
        """Whether to observe the next request's response headers (``health.response_sample_rate``).

        Deterministic: with a rate of 0.25 exactly every fourth request is observed. A request that
        is not observed keeps its in-flight slot until its stream ends (Envoy holds the ext_proc
        stream open until the HTTP request is over) and its prefill counts as pending until then.
        """
        if self.config.splits:  # a canary is judged on every response of its arms
            return True
        return self._responses.take(self.config.health.response_sample_rate)

    def observe_response(self, routed: Routed, status: int, attempts: int = 1, answered_by: str | None = None) -> None:
        """Learn from the response headers Envoy saw: status and time to first byte.

        With ``attempts`` > 1 Envoy tried elsewhere too. A stream's try is reset at its first-byte
        timeout, so the answer is another replica's; a non-streaming try's budget only hedges
        (the first try keeps running), so the answer may still be the chosen replica's, which
        ``answered_by`` (the answering address, when Envoy's config adds it) tells. An answer from
        another replica after the first-byte timeout means the chosen replica's try met it: a
        failure of that replica (three in a row eject it). A quick retry (connection refused or
        reset) is not counted: the scraper sees a replica that refuses connections for itself,
        and a burst that overflows a listen backlog for a moment must not eject a healthy replica.
        """
        replica = routed.decision.replica
        self.metrics.responses_observed.inc()
        if routed.arm is not None:
            labels = (routed.arm.rule, routed.arm.label)
            self.metrics.split_ttft_seconds.labels(*labels).observe(self.clock() - routed.decided_at)
            if status == 0 or status >= 500:
                self.metrics.split_errors.labels(*labels).inc()
        if replica is not None:
            now = self.clock()
            waited = now - routed.decided_at
            if attempts <= 1 or answered_by == replica.address:
                self.replicas.observe(replica.name, status, waited, now)
            elif waited >= self.config.upstream.first_byte_s:
                self.replicas.observe(replica.name, 0, None, now)
            self.replicas.prefilled(replica.name, routed.prefill_tokens)
            routed.prefill_tokens = 0
            self._settle_claim(routed)

    def _settle_claim(self, routed: Routed) -> None:
        """The request's prefill is over (its first byte came back, or the request ended): its
        claim is weighed against the hits the replica reports from now on."""
        if (routed.claimed_tokens or routed.sent_tokens) and routed.decision.replica is not None:
            self.cache_estimate.claimed(routed.decision.replica.name, routed.claimed_tokens, routed.sent_tokens)
            routed.claimed_tokens = routed.sent_tokens = 0

    def release(self, routed: Routed) -> None:
        """The request is over (or abandoned): its in-flight slot is freed, once."""
        if routed.released or routed.decision.replica is None:
            return
        routed.released = True
        self._settle_claim(routed)
        self.inflight_prefixes.remove(routed.decision.replica.name, routed.features.prefix_hashes)
        self.replicas.end(routed.decision.replica.name, routed.prefill_tokens, routed.kv_tokens)
        if routed.tenant_counted:
            self.tenants.end(routed.features.tenant, routed.decision.replica.name)
        routed.prefill_tokens = 0
        if self.queue is not None:
            self.queue.wake()  # a slot freed: the head of the queue may go

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
            self.inflight_prefixes.forget((name,))
            try:
                await self.store.forget_replica(name)
            except Exception as exc:
                self.metrics.store_errors.labels("forget").inc()
                log.debug("store forget failed: %s", exc)
        snapshot = self.replicas.snapshot(now)
        for name in joined:
            await self.rebalancer.on_join(name, self.profile.ring_for(snapshot), snapshot)
            self._warm_hot(name)
        if self.kv_events is not None:
            self.kv_events.sync([rec.replica for rec in self.replicas.records()])
        if joined or left:
            log.info("membership: joined %s, left %s", joined or "-", left or "-")
        return Membership(tuple(joined), tuple(left))

    def _warm_hot(self, name: str) -> int:
        """Send joining replica ``name`` the top hot prefixes, prefill only, through the pre-warmer's
        rate limit (queued now, so they reach it before most of the traffic it is about to take)."""
        if self.hot_keys is None or not self.hot_keys.settings.warm_on_join:
            return 0
        record = self.replicas.record(name)
        if record is None:
            return 0
        sent = 0
        for path, body in self.hot_keys.warm_set():
            sent += self.rebalancer.prewarmer.submit(record.replica.address, path, body, force=True)
        if sent:
            log.info("warming %s with %d hot prefixes", name, sent)
        return sent

    def _warm_hot_members(
        self, key: str | int | None, decision: Decision, features: RequestFeatures, view: AffinityView
    ) -> int:
        """Warm the members new to a hot prefix's replica set (its k grew, or the load bound walked
        past one) with its kept request, prefill only, so they hold it before its traffic reaches
        them; the chosen replica is warmed by this request itself. A member believed to hold half
        of the prompt already is left alone."""
        if self.hot_keys is None or key is None or decision.replica is None:
            return 0
        fp = fingerprint(key)
        exemplar = self.hot_keys.exemplar(fp)
        if exemplar is None:
            return 0
        total = len(features.prefix_hashes)
        holding = {decision.replica.name} | {
            name for name, n in view.prefix_matches.items() if total and 2 * n >= total
        }
        sent = 0
        for name in self.hot_keys.newcomers(fp, decision.hot_set, holding):
            record = self.replicas.record(name)
            if record is not None:
                sent += self.rebalancer.prewarmer.submit(record.replica.address, *exemplar, force=True)
        if sent:
            log.info("warming %d new replicas of hot prefix %s", sent, label(fp))
        return sent

    async def after_scrape(self, transitions: Sequence[Transition]) -> None:
        """After each health round: move the sessions of replicas that left the rotation, and shed
        sessions from replicas that have run hot for a while."""
        if self.kv_events is not None:  # the engines' cache layout as their pages report it
            self.kv_events.engine_pages(
                (rec.replica.name, rec.metrics.block_size, rec.metrics.hash_algo, rec.metrics.models)
                for rec in self.replicas.records()
                if rec.metrics is not None
            )
        if self.queue is not None:
            self.queue.wake()  # fresh load figures: headroom may have appeared
        snapshot = self.replicas.snapshot(self.clock())
        await self.refresh_cordons()
        for t in transitions:
            if not t.in_rotation:
                await self.rebalancer.on_leave(t.replica, self.profile.ring_for(snapshot), snapshot)
        await self.rebalancer.check_hot(snapshot)
