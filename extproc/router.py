"""The router facade: it wires the collaborators and runs a request through them.

A request is read once (features and its parsed body), may take a split's arm, is tokenized where
a tokenizer serves its model, waits in the fair queue while the fleet is full, and is decided on
one set of inputs (:meth:`Router.inputs`: the store's view weighed by what the replicas report,
their health and load, the tenant's terms, the cordons, the hot prefixes). Then the bookkeeping
hooks count it where it went (:mod:`extproc.bookkeeping`) and the store records its pin and
prefix. Explain asks the same inputs without refreshing or recording anything.

It knows no gRPC. The ext_proc servicer hands it headers and body bytes and gets back a
:class:`Routed` to translate into Envoy's language; the simulator drives the same object.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from extproc.bookkeeping import (
    CacheHook,
    Hook,
    LatencyHook,
    LoadHook,
    ObjectiveHook,
    PrefillHop,
    RateHook,
    Routed,
    TenantHook,
    answered,
    decided,
    ended,
)
from extproc.budgets import Admission as BudgetAdmission
from extproc.budgets import BudgetLedger, BudgetStore
from extproc.cache import CacheView, ReplicaCaches
from extproc.cache.reuse import ReuseLedger
from extproc.config import Config
from extproc.decisions import DecisionFeed
from extproc.engine_rates import EngineRates
from extproc.health.latency import LatencyBook
from extproc.health.rates import RateBook
from extproc.health.replicas import ReplicaBook, Transition
from extproc.hotkeys.detector import HotKeyDetector
from extproc.hotkeys.warming import HotKeyWarmer
from extproc.membership import FleetControl, Membership
from extproc.metering import TokenMeter
from extproc.metrics import RouterMetrics
from extproc.queueing import FairQueue, Refusal, saturated
from extproc.rebalance.prewarm import Prewarmer
from extproc.rebalance.rebalancer import Rebalancer
from extproc.request.agent_apis import RESPONSES_PATH, answer_messages
from extproc.request.features import (
    CHARS_PER_TOKEN,
    SLO_TPOT_HEADERS,
    SLO_TTFT_HEADERS,
    ParsedRequest,
    RequestFeatures,
    read_request,
    request_path,
    uncached_tokens,
    with_block_hashes,
    with_chain,
    with_model,
    with_response_id,
)
from extproc.request.openai_body import INFERENCE_PATHS, USAGE_ASKED_PATHS, costs_tokens
from extproc.request.splits import Arm, choose_arm, encode_body
from extproc.routing.hot import fingerprint
from extproc.routing.latency import LatencyView, LearnedRates, LoadPoint
from extproc.routing.model import AffinityView, Decision, Reason, Replica
from extproc.routing.pipeline import Decider, DecisionInputs, Profile, Profiles, decide
from extproc.routing.registry import build_profile
from extproc.routing.trace import DecisionTrace, Explanation
from extproc.sampling import RateSampler
from extproc.state.conversations import Conversations
from extproc.state.memory import MemoryStore
from extproc.state.store import AffinityStore
from extproc.tenancy import TenantLedger
from extproc.tracing import DecisionTracer
from extproc.usage import Usage, ask_for_usage
from extproc.world import REAL_WORLD, World

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.kvevents.cache_state import EventCacheState

__all__ = ["Membership", "Routed", "Router", "build_profiles"]

log = logging.getLogger("extproc.router")

OBJECTIVE_HEADERS = (*SLO_TTFT_HEADERS, *SLO_TPOT_HEADERS)
OBJECTIVE_MESSAGE = "no replica is predicted to meet this request's latency objectives now; retry later"
BUDGET_MESSAGES = {
    kind: f"this {whose} token budget is spent for now; retry after the window resets"
    for kind, whose in (("tenant", "tenant's"), ("key", "API key's"), ("model", "model's"))
}
"""The refusal's words, by the budget that refused (a tenant's, an API key's, a model's)."""
PATH_REFUSED = "this API is not served through this gateway (budgets.other_paths: refuse)"

Clock = Callable[[], float]


def known_tenants(config: Config) -> set[str]:
    """The tenants the config names (quotas, API keys, budgets): metered under their own names."""
    tenants = config.tenants
    return {*tenants.definitions, *tenants.api_keys.values(), *config.budgets.tenants}


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
        clock: Clock | None = None,
        metrics: RouterMetrics | None = None,
        profile: Profile | None = None,
        *,
        replicas: ReplicaBook | None = None,
        tenants: TenantLedger | None = None,
        prewarmer: Prewarmer | None = None,
        kv_events: EventCacheState | None = None,
        decider: Decider = decide,
        hot_keys: HotKeyDetector | None = None,
        tracer: DecisionTracer | None = None,
        budget_store: BudgetStore | None = None,
        world: World | None = None,
    ) -> None:
        """Wire the collaborators: each is built from ``config`` unless given (tests and the
        simulator give their own store, clock, default profile or pre-warmer; the simulator's
        peer routers their own ``decider``). ``world`` is the only source of time and chance
        (:mod:`extproc.world`); ``clock``, given, replaces its monotonic clock."""
        self.world = world = (world or REAL_WORLD) if clock is None else (world or REAL_WORLD).with_clock(clock)
        clock = world.monotonic
        self.config = config
        self.decide = decider
        self.tracer = tracer  # ``tracing:``: decision spans over OTLP
        # ``budgets:``: every response's usage read and metered; token budgets by tenant, API key
        # and model (shared with Redis).
        self.budgets = BudgetLedger(config.budgets, budget_store) if config.budgets.enabled else None
        self.kv_events = kv_events  # vLLM's KV events: where a replica's feed is live, its matches
        self._responses = RateSampler()  # health.response_sample_rate
        self._timings = RateSampler()  # health.token_timing_rate
        self.store: AffinityStore = store or MemoryStore(
            config.sessions.ttl_s, config.sessions.max_sessions, config.prefix.blocks_per_replica
        )
        # Keyless chat requests' conversations, new ones named from the world's random source.
        self.conversations = Conversations(self.store, lambda: world.random.getrandbits(64))
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.meter: TokenMeter | None = None
        if config.budgets.enabled:
            self.meter = TokenMeter(known_tenants(config), self.metrics, world.wall())
        self.profiles = build_profiles(config, profile)
        self.tenants = tenants or TenantLedger(config.tenants)
        self.replicas = replicas or ReplicaBook(config.replicas, config.health)
        block_tokens = config.features.block_chars // CHARS_PER_TOKEN
        self.pairing = config.disaggregation.pair_settings(block_tokens)  # read where replicas carry roles
        self.caches = ReplicaCaches(self.replicas, self.store, block_tokens, kv_events)
        self.reuse = ReuseLedger(self._labels_of, world.wall)  # where the hit ratio goes (extproc.cache.reuse)
        self.queue: FairQueue | None = None
        if config.queueing.enabled:
            self.queue = FairQueue(config.queueing, self.fleet_saturated, self.metrics, world=world)
        self.rebalancer = Rebalancer(
            config.rebalance,
            self.store,
            clock,
            self.metrics,
            prewarmer,
            session_ttl_s=config.sessions.ttl_s,
            world=world,
        )
        self.feed = DecisionFeed(wall=world.wall)  # WatchDecisions and the console; costs nothing unwatched
        # Hot prefixes (``hot_keys:``): sampled fingerprints; the decision is given the hot table.
        self.hot_keys = hot_keys
        if self.hot_keys is None and config.hot_keys.enabled:
            self.hot_keys = HotKeyDetector(config.hot_keys, now=clock())
        self.warmer = HotKeyWarmer(self.hot_keys, self._prewarm) if self.hot_keys is not None else None
        self.fleet = FleetControl(
            self.replicas,
            self.store,
            self.caches,
            self.rebalancer,
            clock,
            lambda: self.profile,
            self.metrics.store_error,
            queue=self.queue,
            warmer=self.warmer,
            kv_events=kv_events,
        )
        self.fleet.forget_picked = self.profiles.forget
        # Each replica's TTFT and TPOT, learned from responses where objectives are in use.
        # The pools' prior engine speeds (health.engine_rates): the rate learner's start and the
        # price's fallback, one config place for both.
        priors = tuple(p.pool() for p in config.health.engine_rates)
        self.latency = LatencyBook(block_tokens, learning=config.health.latency_models == "always", priors=priors)
        self._learn_on_objective = config.health.latency_models == "auto"
        # Each replica's engine speeds (cold prefill, decode step), from the same observations,
        # from its pool's prior (health.engine_rates): what a choice can be priced in seconds with.
        self.rates = RateBook(priors)
        self.hooks: tuple[Hook, ...] = (
            LoadHook(self.replicas),
            CacheHook(self.caches),
            TenantHook(self.tenants),
            LatencyHook(self.latency, clock),
            ObjectiveHook(self.metrics, clock),
            RateHook(self.rates, self._labels),
        )

    @property
    def profile(self) -> Profile:
        """The default profile (request classes may choose others: :attr:`profiles`)."""
        return self.profiles.default

    @property
    def cordons(self) -> Mapping[str, str]:
        """The replicas cordoned or drained, as last read from the store."""
        return self.fleet.cordons

    # -- the request path ---------------------------------------------------------------------
    async def route(self, headers: Mapping[str, str], body: bytes | None, timed: bool = False) -> Routed:
        """Decide where a request goes and record the decision (pin, prefix index, in-flight).
        ``timed``: its response body will be read for when its tokens came, so a stream is asked
        for the usage it reports (its output tokens; the chunk is taken out again for a client
        that did not ask)."""
        start, started_ns = self.clock(), int(self.world.wall() * 1e9)
        arrived = start
        # Hashed once the model served and the tokenizer's part are known: each hash once.
        request = read_request(headers, body, self.config.features, hashed=False)
        if request.features.body_error is not None and body is not None:
            self.metrics.body_errors.inc()
        arm, changed, strip_usage = None, False, False
        if self.config.splits and request.body is not None:
            request, arm, changed = self._split(headers, request)
        if request.features.path == RESPONSES_PATH and request.body is not None:
            request, named = self._name_response(headers, request)
            changed = changed or named
        asking = request.features.path in USAGE_ASKED_PATHS  # the agent APIs' streams always report
        if (self.budgets is not None or timed) and request.body is not None and asking:
            asked = ask_for_usage(request.body.body)  # so that a stream reports what it used
            if asked is not None:
                request = ParsedRequest(request.features, replace(request.body, body=asked))
                changed = strip_usage = True
        # The body sent instead of the client's, serialized once whatever changed it.
        rewritten = encode_body(request.body.body) if changed and request.body is not None else None
        request = with_chain(request, self.config.features)
        features = await self.conversations.identify(request.features, start)
        if features.conversation is not None and features.conversation.match is not None:
            self.metrics.conversations.labels(features.conversation.match).inc()
        features = await self._hashed(features, request)
        budget = None
        if self.budgets is not None and costs_tokens(features.path):
            if features.path not in INFERENCE_PATHS and self.config.budgets.other_paths == "refuse":
                refusal = Refusal(403, 0, PATH_REFUSED, "path_refused")
                self.metrics.shed(features.request_class, refusal.kind)
                return Routed(features, Decision(None, Reason.QUOTA), self.clock(), refusal=refusal)
            key = self.budgets.key_digest(headers)
            # A body not parsed (over max_body_bytes, not JSON, another API's) reserves by its size.
            budget = await self.budgets.admit(
                features.tenant, self._prompt_charge(features), self.world.wall(), key_digest=key, model=features.model
            )
            if not budget.admitted:
                words = BUDGET_MESSAGES[budget.refused_by or "tenant"]
                refusal = Refusal(429, budget.retry_after_s, words, "tokens_exceeded")
                self.metrics.shed(features.request_class, refusal.kind)
                return Routed(features, Decision(None, Reason.QUOTA), self.clock(), refusal=refusal, budget=budget)
        ticket = None
        held_by_queue = self.queue is not None and features.path in INFERENCE_PATHS  # /v1/models is never held
        if self.queue is not None and held_by_queue:
            demotion = features.hints.demotion
            held = await self.queue.admit(features.request_class, features.tenant, features.pool, demotion=demotion)
            if isinstance(held, Refusal):
                return self._refused_by_queue(features, held, arm, budget)
            ticket = held
            start = self.clock()  # the decision is made now, on the load as it is now
        sent = (rewritten or body) if request.body is not None else None  # a usable body, as sent
        try:
            routed = await self._route(features, start, sent, may_wait=held_by_queue)
        finally:
            if ticket is not None:
                ticket.settle()
        if routed.objective_wait is not None and self.queue is not None:
            # Every candidate is predicted to miss and the class queues: wait until one is predicted
            # to meet them (or the fleet is idle), then decide again and go wherever that says.
            ready = self.objective_ready(features, routed.objective_wait)
            held = await self.queue.admit(
                features.request_class, features.tenant, features.pool, ready, features.hints.demotion
            )
            if isinstance(held, Refusal):
                return self._refused_by_queue(features, held, arm, budget)
            start = self.clock()
            try:
                routed = await self._route(features, start, sent)
            finally:
                if held is not None:
                    held.settle()
        routed.arrived_at = arrived
        routed.arm, routed.body, routed.budget, routed.strip_usage = arm, rewritten, budget, strip_usage
        if self.tracer is not None:
            profile = self.profiles.for_request(features).name
            routed.trace = self.tracer.decided(
                headers, features, routed.decision, started_ns, len(self.replicas), profile
            )
        if arm is not None:
            self.metrics.split_requests.labels(arm.rule, arm.label).inc()
        replica = routed.decision.replica
        if features.session_key and sent and replica is not None:
            hashes = features.prefix_hashes  # kept: a move indexes the session in this key space
            self.rebalancer.note(features.session_key, features.model, replica.name, features.path, sent, start, hashes)
        return routed

    def keeps_answers(self, headers: Mapping[str, str]) -> bool:
        """Whether a request's answer is read for what its engine stores of it: a Responses API
        request where KV events are read (its next turn is hashed in the engine's key space)."""
        return self.kv_events is not None and request_path(headers) == RESPONSES_PATH

    def answered(self, routed: Routed, body: bytes) -> None:
        """A Responses answer read whole: the conversation its engine stores under its id."""
        response_id = routed.features.response_id
        if self.kv_events is None or response_id is None:
            return
        answer = answer_messages(body)
        if answer is not None:
            self.kv_events.responses.answered(response_id, answer)

    def _name_response(self, headers: Mapping[str, str], request: ParsedRequest) -> tuple[ParsedRequest, bool]:
        """A Responses request that may be stored and names no ``request_id`` is given one (the id
        vLLM gives its response): its next turn's ``previous_response_id`` then finds its replica,
        the only one that holds the conversation. True when the body changed."""
        assert request.body is not None
        body = request.body.body
        if "request_id" in body or body.get("store") is False:
            return request, False
        return with_response_id(request, f"resp_{uuid.uuid4().hex}", headers, self.config.features), True

    def _refused_by_queue(
        self, features: RequestFeatures, refusal: Refusal, arm: Arm | None, budget: BudgetAdmission | None
    ) -> Routed:
        if self.budgets is not None and budget is not None:
            self.budgets.release(budget)
        self.metrics.shed(features.request_class, refusal.kind)
        return Routed(features, Decision(None, Reason.NO_REPLICA), self.clock(), arm=arm, refusal=refusal)

    async def route_features(
        self, features: RequestFeatures, start: float | None = None, *, may_wait: bool = False
    ) -> Routed:
        """:meth:`route` for a request already turned into features (the simulator's entry point,
        which holds requests itself: with ``may_wait`` a request whose class queues on a predicted
        miss comes back unrouted with ``objective_wait`` set, for its own queue to hold)."""
        start = self.clock() if start is None else start
        routed = await self._route(features, start, None, may_wait=may_wait)
        routed.arrived_at = start
        return routed

    async def _route(
        self, features: RequestFeatures, start: float, body: bytes | None, *, may_wait: bool = False
    ) -> Routed:
        """Decide on the inputs as they are at ``start``, count the request where it went, record
        its pin and prefix; ``body`` (a usable one) is kept as a hot prefix's exemplar if wanted.
        A request every candidate is predicted to miss goes as its class's ``on_miss`` says: shed
        (refused, nothing counted), held (``may_wait``: returned unrouted with ``objective_wait``,
        nothing counted) or routed as decided."""
        try:
            stored = await self.store.lookup(features.session_key, features.prefix_hashes, start, model=features.model)
        except Exception as exc:  # the store is an optimisation: route on hashing without it
            self.metrics.store_error("lookup")
            log.debug("store lookup failed: %s", exc)
            stored = AffinityView()
        self.caches.refresh(start)
        given, cached = self.inputs(features, stored, start)
        fp = None  # the prefix key's fingerprint, once a request, where hot keys are on
        if self.hot_keys is not None:
            fp = fingerprint(given.prefix_key) if given.prefix_key is not None else None
            self.hot_keys.observe_fingerprint(fp, features.prompt_chars // CHARS_PER_TOKEN, start)
            given = replace(given, hot=self.hot_keys.table(), prefix_fingerprint=fp)
        decision = self.decide(given)
        if decision.reason is Reason.QUOTA:
            self.metrics.shed(features.request_class, "quota_exceeded")
        elif self._misses(features, decision):
            unrouted = self._missed(features, stored, start, may_wait)
            if unrouted is not None:
                return unrouted
        routed = Routed(features, decision, start)
        replica = decision.replica
        if replica is not None:
            block_chars = self.config.features.block_chars
            routed.prefill_tokens = routed.kv_tokens = uncached_tokens(features, decision.matched_blocks, block_chars)
            routed.sent_tokens = features.estimated_prompt_tokens
            claimed = cached.claims.get(replica.name, 0)
            routed.claimed_tokens = routed.sent_tokens - uncached_tokens(features, claimed, block_chars)
            if decision.prefill is not None:
                routed.hop = self._hop(features, decision.prefill.name, given.view, cached)
                routed.prefill_tokens = 0  # the decode replica takes the prompt's blocks, computes none
            if self._learn_on_objective and (features.slo_ttft_ms is not None or features.slo_tpot_ms is not None):
                self.latency.wanted()
            state = given.snapshot.get(replica.name)
            # A hop's first byte is two replicas' work: not the decode replica's latency to learn.
            if state is not None and routed.hop is None and self.latency.learning:
                routed.load_point = LoadPoint.of(state, routed.prefill_tokens)
            decided(self.hooks, routed, start)
            if self.warmer is not None:
                matches, total = given.view.prefix_matches, len(features.prefix_hashes)
                self.warmer.widened(fp, decision.hot_set, replica.name, matches, total)
            try:
                await self.store.record(
                    features.session_key,
                    replica.name,
                    features.prefix_hashes,
                    start,
                    decision.pin,
                    model=features.model,
                )
                await self.conversations.remember(features, start)
                if decision.prefill is not None:  # it holds the prompt too once it prefilled it
                    await self.store.record(
                        None, decision.prefill.name, features.prefix_hashes, start, False, model=features.model
                    )
            except Exception as exc:
                self.metrics.store_error("record")
                log.debug("store record failed: %s", exc)
        if self.warmer is not None and body:
            self.warmer.offer(fp, features.path, body)
        routed.decided_at = self.clock()
        self._report(features, decision, given.view, start, routed.decided_at)
        return routed

    def _misses(self, features: RequestFeatures, decision: Decision) -> bool:
        """Whether the request is predicted to miss its objectives everywhere, as its class judges
        it: short of the class's ``admit_margin`` where it sheds or queues."""
        if decision.objective_missed:
            return True
        headroom = decision.objective_headroom
        if headroom is None:
            return False
        terms = self.config.queueing.for_class(features.request_class)
        return terms.on_miss != "best_effort" and headroom < terms.admit_margin

    def _missed(self, features: RequestFeatures, stored: AffinityView, now: float, may_wait: bool) -> Routed | None:
        """A request every candidate is predicted to miss: refused if its class sheds, returned to
        wait if it queues and may, else None (routed best effort)."""
        terms = self.config.queueing.for_class(features.request_class)
        if terms.on_miss == "shed":
            refusal = Refusal(429, terms.retry_after_s, OBJECTIVE_MESSAGE, "objective")
            self.metrics.shed(features.request_class, refusal.kind)
            return Routed(
                features, Decision(None, Reason.NO_REPLICA, retry_after_s=terms.retry_after_s), now, refusal=refusal
            )
        if terms.on_miss == "queue" and may_wait and not self._idle(now):
            return Routed(features, Decision(None, Reason.NO_REPLICA), now, objective_wait=stored)
        return None

    def _idle(self, now: float) -> bool:
        """Nothing in flight anywhere: waiting for load to drain cannot bring an objective closer."""
        return all(max(s.inflight, s.running + s.queue) == 0 for s in self.replicas.snapshot(now).replicas)

    def objective_ready(self, features: RequestFeatures, stored: AffinityView) -> Callable[[], bool]:
        """For a request held for its objectives: whether it may go now, judged on the fleet as it
        is (the store's view as it was when it was held): a decision made now would not predict
        a miss, or the fleet has nothing in flight. Nothing is recorded."""

        def ready() -> bool:
            now = self.clock()
            try:
                given, _ = self.inputs(features, stored, now)
                return self._idle(now) or not self._misses(features, self.decide(given))
            except Exception:  # never hold a request on a failing judgement
                log.exception("judging a held request's objectives failed; releasing it")
                return True

        return ready

    def _hop(self, features: RequestFeatures, name: str, view: AffinityView, cached: CacheView) -> PrefillHop:
        """What a prefill hop to ``name`` is counted for there (:class:`PrefillHop`)."""
        block_chars = self.config.features.block_chars
        matched = view.prefix_matches.get(name, 0)
        claimed = features.estimated_prompt_tokens - uncached_tokens(features, cached.claims.get(name, 0), block_chars)
        return PrefillHop(name, uncached_tokens(features, matched, block_chars), matched, claimed)

    def inputs(
        self, features: RequestFeatures, stored: AffinityView, now: float, *, explain: bool = False
    ) -> tuple[DecisionInputs, CacheView]:
        """The decision's inputs for ``features``, from the store's view ``stored``, and the cache
        view they hold (the claims before trust; for Explain, each match's source). The hot table
        is the caller's to add: the request path counts the request first, Explain does not."""
        cached = self.caches.view(stored, features, now, explain=explain)
        given = DecisionInputs.of(
            features,
            self.replicas.snapshot(now, self.tenants.by_replica),
            cached.view,
            now,
            self.profiles.for_request(features),
            self.tenants.terms(features.tenant, len(self.replicas)),
            cordons=self.fleet.cordons,
            latency=self._latency_view(),
            pairing=self.pairing,
            block_chars=self.config.features.block_chars,
        )
        return given, cached

    async def explain(self, headers: Mapping[str, str], body: bytes | None) -> Explanation:
        """The decision :meth:`route` would make for this request now, with its trace, and
        without side effects: nothing is pinned, counted, indexed or refreshed."""
        now = self.clock()
        request = with_chain(read_request(headers, body, self.config.features, hashed=False), self.config.features)
        features = await self.conversations.identify(request.features, now, peek=True)
        features = await self._hashed(features, request)  # as route() hashes them (a memo, no state)
        try:
            stored = await self.store.peek(features.session_key, features.prefix_hashes, now, model=features.model)
        except Exception as exc:  # as route(): without the store, the decision hashes
            log.debug("store peek failed: %s", exc)
            stored = AffinityView()
        given, cached = self.inputs(features, stored, now, explain=True)
        if self.hot_keys is not None:
            given = replace(given, hot=self.hot_keys.table())
        trace = DecisionTrace()
        decision = self.decide(given, trace)
        block_chars = self.config.features.block_chars
        names = [s.name for s in given.snapshot.replicas]
        uncached = {n: uncached_tokens(features, given.view.prefix_matches.get(n, 0), block_chars) for n in names}
        evidence = self.caches.evidence(names, now)
        cordons = dict(self.fleet.cordons)
        on_miss = (
            self.config.queueing.for_class(features.request_class).on_miss if self._misses(features, decision) else ""
        )
        return Explanation(
            features,
            decision,
            trace,
            given.view,
            given.snapshot,
            uncached,
            cordons,
            cached.sources,
            evidence,
            on_miss=on_miss,
        )

    async def _hashed(self, features: RequestFeatures, request: ParsedRequest) -> RequestFeatures:
        """``features`` with its prompt's block keys: the tokenizer's where one serves its model,
        else character blocks (computed only then)."""
        if self.kv_events is not None:
            features = await self.kv_events.tokenized(features, request.body.body if request.body else None)
        return with_block_hashes(features, request.body, self.config.features)

    def offer_hot_body(self, features: RequestFeatures, body: bytes | Callable[[], bytes]) -> None:
        """Keep a request of a hot prefix (one per hot key) to warm joining replicas with; ``body``
        may be a function that builds it, called only when one is wanted (the simulator's)."""
        if self.warmer is not None:
            key = self.profiles.for_request(features).prefix_key(features)
            self.warmer.offer(fingerprint(key) if key is not None else None, features.path, body)

    def _split(self, headers: Mapping[str, str], request: ParsedRequest) -> tuple[ParsedRequest, Arm | None, bool]:
        """The request's split arm, and whether its body changed: rewritten to the arm's model,
        its features taken again from that body (not parsed again), so the prefix hashes are
        seeded with the model actually served."""
        features, parsed = request.features, request.body
        if parsed is None:
            return request, None, False
        key = features.session_key or parsed.user or features.request_id or None
        arm = choose_arm(self.config.splits, features.model, headers, key)
        if arm is None:
            return request, None, False
        changed = arm.target.model != features.model
        if changed:
            request = with_model(request, arm.target.model, headers, self.config.features, hashed=False)
        if arm.target.pool is not None:
            request = ParsedRequest(replace(request.features, pool=(("pool", arm.target.pool),)), request.body)
        return request, arm, changed

    def fleet_saturated(self, pool: tuple[tuple[str, str], ...]) -> bool:
        """Whether every candidate of ``pool`` is saturated now (``queueing:`` thresholds)."""
        return saturated(self.replicas.snapshot(self.clock()), pool, self.config.queueing)

    def _labels_of(self, name: str) -> Mapping[str, str] | None:
        record = self.replicas.record(name)
        return record.replica.labels if record is not None else None

    def _prewarm(self, name: str, path: str, body: bytes) -> bool:
        record = self.replicas.record(name)
        return record is not None and self.rebalancer.prewarmer.submit(record.replica.address, path, body, force=True)

    def _report(
        self, features: RequestFeatures, decision: Decision, view: AffinityView, start: float, now: float
    ) -> None:
        """The decision in the metrics, the decision feed and the debug log."""
        m = self.metrics
        m.decisions.labels(decision.reason.value, m.model_label(features.model or "none")).inc()
        m.decision_seconds.observe(now - start)
        if decision.pair is not None:
            m.disaggregated(
                decision.pair.value, decision.prefill.name if decision.prefill else None, decision.transfer_blocks
            )
        if decision.total_blocks:
            m.prefix_blocks.inc(decision.total_blocks)
            m.prefix_blocks_matched.inc(decision.matched_blocks)
            if view.prefix_matches and len(self.replicas):
                m.prefix_blocks_round_robin.inc(sum(view.prefix_matches.values()) / len(self.replicas))
            if decision.replica is not None:
                self.reuse.routed(
                    decision.replica.name, decision.total_blocks, view.prefix_matches, decision.matched_blocks
                )
        if self.feed.watched:
            self.feed.publish(decision, features.model, now - start)
        if log.isEnabledFor(logging.DEBUG):
            replica = decision.replica.name if decision.replica else None
            log.debug(
                "decision request_id=%s replica=%s reason=%s matched=%d/%d moved_by=%s",
                features.request_id,
                replica,
                decision.reason.value,
                decision.matched_blocks,
                decision.total_blocks,
                decision.moved_by or "-",
                extra={
                    "event": "decision",
                    "request_id": features.request_id,
                    "replica": replica,
                    "reason": decision.reason.value,
                    "model": features.model,
                    "matched_blocks": decision.matched_blocks,
                    "total_blocks": decision.total_blocks,
                    "moved_by": decision.moved_by,
                    "prefill": decision.prefill.name if decision.prefill else None,
                    "pair": decision.pair.value if decision.pair else None,
                    "stream": features.stream,
                    "decision_ms": round((now - start) * 1000, 3),
                },
            )

    # -- what comes back ----------------------------------------------------------------------
    def engine_rates(self) -> dict[str, EngineRates]:
        """Every replica's engine speeds: learnt where its answers were observed alone, else its
        pool's prior (``health.engine_rates``)."""
        out = {}
        for rec in self.replicas.records():
            out[rec.replica.name] = self.rates.rates(rec.replica.name, rec.replica.labels)
        return out

    def _latency_view(self) -> LatencyView:
        """The latency models' fits, with the engine rates learnt so far for the price."""
        view = self.latency.view()
        learned = self._learned_rates()
        return replace(view, rates=learned) if learned else view

    def _learned_rates(self) -> dict[str, LearnedRates]:
        """What the price takes from the engine rates: only what was learnt (a prior stays the
        price's own, so a replica nothing was observed of is priced as its pool is). Per decision:
        only the replicas observed are read (none until answers are timed), no prior is made."""
        out = {}
        for name, r in self.rates.view().items():
            prefill = r.prefill_tokens_per_s if r.prefill_samples > 0 else None
            overhead = r.overhead_s if r.prefill_samples > 0 else None
            decode = r.decode_step_s if r.decode_samples > 0 else None
            if prefill is not None or decode is not None:
                out[name] = LearnedRates(prefill_tokens_per_s=prefill, decode_s_per_token=decode, overhead_s=overhead)
        return out

    def _labels(self, name: str) -> Mapping[str, str]:
        rec = self.replicas.record(name)
        return rec.replica.labels if rec is not None else {}

    def times_tokens(self, headers: Mapping[str, str]) -> bool:
        """Whether a sampled response's body is read for when its tokens came (its time to first
        token and per output token): wherever the latency models learn (``health.latency_models``),
        or would from this request on (it may carry an objective), and where split arms are
        compared (their TTFT); or always, or never (``health.token_timing``)."""
        timing = self.config.health.token_timing
        if timing != "auto":
            return timing == "always"
        if self.latency.learning or self.config.splits:
            return True
        if not self._learn_on_objective:
            return False
        features = self.config.features
        if features.tenant_objectives or any(rule.objectives is not None for rule in features.classes):
            return True
        return any(name in headers for name in OBJECTIVE_HEADERS)

    def sample_timing(self) -> bool:
        """Whether this answer, one :meth:`times_tokens` would time, is (``health.token_timing_rate``)."""
        return self._timings.take(self.config.health.token_timing_rate)

    def sample_response(self) -> bool:
        """Whether to observe the next request's response headers (``health.response_sample_rate``).

        Deterministic: with a rate of 0.25 exactly every fourth request is observed. A request that
        is not observed keeps its in-flight slot until its stream ends (Envoy holds the ext_proc
        stream open until the HTTP request is over) and its prefill counts as pending until then.
        """
        if self.config.splits:  # a canary is judged on every response of its arms
            return True
        return self._responses.take(self.config.health.response_sample_rate)

    def observe_response(
        self, routed: Routed, status: int, attempts: int = 1, answered_by: str | None = None, timed: bool = False
    ) -> None:
        """Learn from the response headers Envoy saw: status (and, the body not ``timed``, time to
        first byte).

        With ``attempts`` > 1 Envoy tried elsewhere too. A stream's try is reset at its first-byte
        timeout, so the answer is another replica's; a non-streaming try's budget only hedges
        (the first try keeps running), so the answer may still be the chosen replica's, which
        ``answered_by`` (the answering address, when Envoy's config adds it) tells. An answer from
        another replica after the first-byte timeout means the chosen replica's try met it: a
        failure of that replica (three in a row eject it). A quick retry (connection refused or
        reset) is not counted: the scraper sees a replica that refuses connections for itself,
        and a burst that overflows a listen backlog for a moment must not eject a healthy replica.

        ``timed``: its body will be read for when its tokens came (:meth:`first_token`,
        :meth:`tokens_over`): the hooks hear of its first token then, not now. A stream's headers
        say nothing of it: vLLM sends them before the engine has even queued the request.
        """
        replica = routed.decision.replica
        self.metrics.responses_observed.inc()
        ok = 0 < status < 400
        if routed.arm is not None:
            labels = (routed.arm.rule, routed.arm.label)
            if not (timed and ok and routed.features.stream):  # else at its first token
                self.metrics.split_ttft_seconds.labels(*labels).observe(self.clock() - routed.decided_at)
            if status == 0 or status >= 500:
                self.metrics.split_errors.labels(*labels).inc()
        if replica is not None:
            now = self.clock()
            routed.headers_at, routed.status, routed.tries = now, status, attempts
            waited = now - routed.decided_at
            stream_timed = timed and routed.features.stream
            if attempts <= 1 or answered_by == replica.address:
                # A timed stream's first token is what its replica is judged on (first_token).
                self.replicas.observe(replica.name, status, None if stream_timed else waited, now)
            else:
                routed.load_point = None  # its first byte was another replica's: nothing to learn
                if waited >= self.config.upstream.first_byte_s:
                    self.replicas.observe(replica.name, 0, None, now)
            if status >= 400 or status == 0:
                routed.load_point = None  # an error's latency is not the replica's serving time
                timed = False
            routed.timed = timed
            if not timed:
                routed.answered_at = now
                answered(self.hooks, routed)

    def first_token(self, routed: Routed, now: float) -> None:
        """A timed stream's first token passed at ``now``: its prefill is over."""
        replica = routed.decision.replica
        if replica is None or not routed.timed or routed.first_token_seen:
            return
        routed.answered_at, routed.first_token_seen = now, True
        if routed.arm is not None:
            self.metrics.split_ttft_seconds.labels(routed.arm.rule, routed.arm.label).observe(now - routed.decided_at)
        if routed.load_point is not None:  # its own answer, not a retry's or an error's
            self.replicas.observe_first_token(replica.name, now - routed.decided_at, now)
            self.metrics.first_token(replica.name, now - routed.decided_at, "stream")
        answered(self.hooks, routed)

    def first_token_deadline(self, routed: Routed) -> float | None:
        """When a timed stream still waiting for its first token is given up (its decision plus
        ``upstream.first_byte_s``); None when nothing is waited for."""
        if not routed.timed or routed.first_token_seen or not routed.features.stream or routed.released:
            return None
        if routed.tries > 1 and routed.headers_at is not None:
            # Another try answered, sent at most first_byte_s x tries after the decision: its
            # budget runs from its headers.
            return routed.headers_at + self.config.upstream.first_byte_s
        return routed.decided_at + self.config.upstream.first_byte_s

    def first_token_overdue(self, routed: Routed) -> None:
        """A timed stream's replica sent no token by its deadline: a failure of that replica, as a
        first-byte timeout is (three in a row eject it), whatever its headers said."""
        replica = routed.decision.replica
        if replica is None or not routed.timed or routed.first_token_seen:
            return
        routed.timed = False  # given up: never timed again
        routed.load_point = None  # nothing to learn from it
        self.metrics.first_token_timeouts.labels(replica.name).inc()
        if routed.tries <= 1:  # else another replica's try stalled, which one is not known here
            self.replicas.observe(replica.name, 0, None, self.clock())

    def tokens_over(self, routed: Routed, first_at: float | None, last_at: float | None, output_tokens: int) -> None:
        """A timed body is over, with ``output_tokens`` generated (the engine's report, else the
        events counted). A stream: its time per output token from its first and last tokens'
        times. A non-streamed answer, whose headers came with its last token: its first token
        is that time less its decode, ``output_tokens - 1`` gaps at the replica's mean
        inter-token gap as its engine reports it (exact for one token); before the engine has
        reported a gap, the replica's decode step places it for its objectives, and nothing is
        learnt from it. Its prefill is over now, if not before."""
        replica = routed.decision.replica
        if replica is None or not routed.timed:
            return
        if routed.first_token_seen:  # a stream
            if first_at is not None and last_at is not None and output_tokens > 1:
                routed.tpot_s = (last_at - first_at) / (output_tokens - 1)
                self.metrics.observed_tpot_seconds.labels(replica.name).observe(routed.tpot_s)
            return
        if routed.features.stream or routed.answered_at is not None or routed.headers_at is None:
            return  # a stream without a token: nothing learnt
        gap = self.replicas.inter_token_s(replica.name) if output_tokens > 1 else 0.0
        reported = gap is not None
        if gap is None:  # no gap reported yet: the replica's decode step (learnt, else its prior)
            gap = self.rates.rates(replica.name, replica.labels).decode_step_s
        if output_tokens > 0:
            routed.answered_at = max(routed.decided_at, routed.headers_at - (output_tokens - 1) * gap)
            # Learnt from only when the engine reported the gap; judged against objectives either way.
            routed.first_token_seen, routed.first_token_estimated = reported, not reported
            if output_tokens > 1:
                routed.tpot_s = gap
            if reported and routed.load_point is not None:
                ttft_s = routed.answered_at - routed.decided_at
                self.metrics.first_token(replica.name, ttft_s, "unary")
        else:
            routed.answered_at = routed.headers_at
        answered(self.hooks, routed)

    async def charge_usage(self, routed: Routed, usage: Usage) -> None:
        """A response's reported ``usage``: metered (tenant, model, replica) and charged to the
        request's budgets, once."""
        if routed.trace is not None:
            routed.trace.usage(usage)
        self._meter(routed, usage)
        if self.budgets is not None and routed.budget is not None:
            admission, routed.budget = routed.budget, None
            await self.budgets.settle(admission, usage, self.world.wall())

    def estimated_usage(self, routed: Routed, output_seen: int | None = None, ran_s: float = 0.0) -> Usage:
        """What a request used that its response did not report: its prompt (the tokens known,
        else the estimate, else its body's size) and the output seen (a stream's events), or,
        for an answer never seen, an estimate from the time it ran (``budgets.output_tokens_per_s``,
        at most its ``max_tokens``)."""
        features = routed.features
        output = output_seen
        if output is None:
            output = int(max(0.0, ran_s) * self.config.budgets.output_tokens_per_s)
            if features.max_output_tokens is not None:
                output = min(output, features.max_output_tokens)
        return Usage(self._prompt_charge(features), None, output, estimated=True)

    def _prompt_charge(self, features: RequestFeatures) -> int:
        return features.charged_prompt_tokens(self.config.budgets.bytes_per_token)

    def charge_unreported(self, routed: Routed, events: int | None) -> None:
        """A request sent upstream ended without the usage it used being charged (a stream the
        client abandoned or that was reset; ``events``: what of its body was seen, None when no
        body was read): charged an estimate now, once. An answer with an error status, and a
        stream that never answered, cost no engine step worth charging. A non-streamed answer
        cut mid-body (its usage is at its end) ran to its end on the engine before its headers
        left: charged the output estimated from the time it ran, as one never seen."""
        if routed.budget is None:  # charged already, or not metered
            return
        if events is None:
            if routed.status != 0 or routed.features.stream:
                return
            usage = self.estimated_usage(routed, ran_s=self.clock() - routed.decided_at)
        elif events == 0 and not routed.features.stream:
            usage = self.estimated_usage(routed, ran_s=self.clock() - routed.decided_at)
        else:
            usage = self.estimated_usage(routed, events)
        if routed.trace is not None:
            routed.trace.usage(usage)
        self._meter(routed, usage)
        if self.budgets is not None:
            admission, routed.budget = routed.budget, None
            self.budgets.settle_soon(admission, usage, self.world.wall())

    def _meter(self, routed: Routed, usage: Usage) -> None:
        if self.meter is not None:
            replica = routed.decision.replica
            self.meter.charge(routed.features.tenant, routed.features.model, replica.name if replica else "", usage)

    def release_budget(self, routed: Routed) -> None:
        """The request ended without usage to charge: its budgets' reservation goes back."""
        if self.budgets is not None and routed.budget is not None:
            self.budgets.release(routed.budget)
            routed.budget = None

    def release(self, routed: Routed) -> None:
        """The request is over (or abandoned): its in-flight slot is freed, once."""
        if routed.trace is not None:
            trace, routed.trace = routed.trace, None
            trace.end(routed.status)
        if not ended(self.hooks, routed):
            return
        replica = routed.decision.replica
        if replica is not None and routed.headers_at is not None:  # answered: its end-to-end time
            self.metrics.request_completed(replica.name, self.clock() - routed.decided_at)
        if self.queue is not None:
            self.queue.wake()  # a slot freed: the head of the queue may go

    # -- the fleet ----------------------------------------------------------------------------
    async def set_replicas(self, replicas: Sequence[Replica]) -> Membership:
        """Make ``replicas`` the membership (:meth:`FleetControl.set_replicas`)."""
        return await self.fleet.set_replicas(replicas)

    async def refresh_cordons(self) -> dict[str, str]:
        """Read the cordons from the store (:meth:`FleetControl.refresh_cordons`)."""
        return await self.fleet.refresh_cordons()

    async def set_cordon(self, name: str, state: str | None) -> int:
        """Cordon, drain or release a replica (:meth:`FleetControl.set_cordon`)."""
        return await self.fleet.set_cordon(name, state)

    async def after_scrape(self, transitions: Sequence[Transition]) -> None:
        """After each health round (:meth:`FleetControl.after_scrape`)."""
        await self.fleet.after_scrape(transitions)
