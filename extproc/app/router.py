"""The router: the collaborators of the request path, wired once, and its entry points.

A request's path is the request core's (:mod:`extproc.core.request`), steps with no I/O whose
effects (store, queue, budgets, tokenizers) :class:`~extproc.core.effects.Effects` carries out;
what comes back from the replica is :class:`~extproc.core.outcome.Outcomes`' to learn from, what
the request used :class:`~extproc.core.charging.Charges`' to charge, what of the response is read
:class:`~extproc.core.watching.Watching`'s to say. Membership, cordons and drains are
:attr:`Router.fleet`'s.

It knows no gRPC: the ext_proc stream's planner (:mod:`extproc.app.plan`) hands it headers and body
bytes and translates the :class:`Routed` it gets back into Envoy's language.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from extproc.app.room import RoomKeeper
from extproc.base.engine_rates import EngineRates
from extproc.base.world import REAL_WORLD, World
from extproc.config import Config
from extproc.core.admission import admission_rules
from extproc.core.bookkeeping import CacheHook, Hook, LatencyHook, LoadHook, ObjectiveHook, RateHook, Routed, TenantHook
from extproc.core.charging import Charges
from extproc.core.effects import Effects
from extproc.core.explain import explain
from extproc.core.membership import FleetControl, Membership
from extproc.core.outcome import Outcomes
from extproc.core.report import DecisionReport
from extproc.core.request import CoreParts, RequestCore
from extproc.core.watching import Watching
from extproc.fleet.cache import ReplicaCaches
from extproc.fleet.cache.reuse import ReuseLedger
from extproc.fleet.health.latency import LatencyBook
from extproc.fleet.health.output_lengths import OutputLengths
from extproc.fleet.health.rates import RateBook
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing import FairQueue, saturated
from extproc.fleet.queueing.room_gate import room_gate
from extproc.fleet.rebalance.prewarm import Prewarmer
from extproc.fleet.rebalance.rebalancer import Rebalancer
from extproc.observe.decisions import DecisionFeed
from extproc.observe.hotkeys.detector import HotKeyDetector
from extproc.observe.hotkeys.warming import HotKeyWarmer
from extproc.observe.metrics import RouterMetrics
from extproc.observe.tracing import DecisionTracer
from extproc.request.features import CHARS_PER_TOKEN, RequestFeatures
from extproc.routing.hot import fingerprint
from extproc.routing.latency import LatencyView
from extproc.routing.pipeline import Decider, Profile, Profiles, decide
from extproc.routing.registry import build_profile
from extproc.routing.trace import Explanation
from extproc.state.budgets import BudgetLedger, BudgetStore
from extproc.state.conversations import Conversations
from extproc.state.memory import MemoryStore
from extproc.state.metering import TokenMeter
from extproc.state.store import AffinityStore
from extproc.state.tenancy import TenantLedger

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.fleet.kvevents.cache_state import EventCacheState

__all__ = ["Membership", "Routed", "Router", "build_profiles"]

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
        (:mod:`extproc.base.world`); ``clock``, given, replaces its monotonic clock."""
        self.world = world = (world or REAL_WORLD) if clock is None else (world or REAL_WORLD).with_clock(clock)
        clock = world.monotonic
        self.config = config
        self.decide = decider
        self.tracer = tracer  # ``tracing:``: decision spans over OTLP
        # ``budgets:``: every response's usage read and metered; token budgets by tenant, API key
        # and model (shared with Redis).
        self.budgets = BudgetLedger(config.budgets, budget_store) if config.budgets.enabled else None
        self.kv_events = kv_events  # vLLM's KV events: where a replica's feed is live, its matches
        self.store: AffinityStore = store or MemoryStore(
            config.sessions.ttl_s, config.sessions.max_sessions, config.prefix.blocks_per_replica
        )
        if kv_events is not None:  # Responses conversations kept with the sessions' TTL (in Redis: shared)
            kv_events.keep_responses(self.store, config.sessions.ttl_s)
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
        self.caches = ReplicaCaches(self.replicas, self.store, block_tokens, kv_events)
        self.reuse = ReuseLedger(self._labels_of, world.wall)  # where the hit ratio goes (extproc.fleet.cache.reuse)
        self.queue: FairQueue | None = None
        if config.queueing.enabled:
            self.queue = FairQueue(config.queueing, self.fleet_saturated, self.metrics, world=world)
        gate = room_gate(config.queueing, clock, config.workers)
        self.room = RoomKeeper(gate, self.replicas, self.metrics, clock, block_tokens) if gate else None
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
        # Each replica's TTFT and TPOT, learned from responses where objectives are in use.
        # The pools' prior engine speeds (health.engine_rates): the rate learner's start and the
        # price's fallback, one config place for both.
        priors = tuple(p.pool() for p in config.health.engine_rates)
        self.latency = LatencyBook(block_tokens, learning=config.health.latency_models == "always", priors=priors)
        # Each replica's engine speeds (cold prefill, decode step), from the same observations,
        # from its pool's prior (health.engine_rates): what a choice can be priced in seconds with.
        self.rates = RateBook(priors)
        self.outputs = OutputLengths()
        self.hooks: tuple[Hook, ...] = (
            LoadHook(self.replicas, clock),
            CacheHook(self.caches),
            TenantHook(self.tenants),
            LatencyHook(self.latency, clock),
            ObjectiveHook(self.metrics, clock),
            RateHook(self.rates, self._labels),
        )
        # What comes back, what is charged, what of the response is read.
        self.outcomes = Outcomes(
            config, clock, self.metrics, self.replicas, self.rates, self.hooks, self.queue, self.outputs
        )
        self.charges = Charges(config, clock, world.wall, self.budgets, self.meter)
        self.watching = Watching(config, self.latency, kv_events)
        # The request path: steps with no I/O, and what carries out their effects.
        self.effects = Effects(
            self.store,
            self.conversations,
            self.metrics.store_error,
            budgets=self.budgets,
            queue=self.queue,
            kv_events=kv_events,
            room=self.room,
        )
        rules = admission_rules(config, self.budgets, self.queue, self.charges.prompt_charge, world.wall)
        self.core = RequestCore(
            CoreParts(
                config=config,
                clock=clock,
                wall=world.wall,
                metrics=self.metrics,
                replicas=self.replicas,
                caches=self.caches,
                tenants=self.tenants,
                profiles=self.profiles,
                decide=decider,
                latency=self.latency,
                latency_view=self.latency_view,
                cordons=lambda: self.fleet.cordons,
                hooks=self.hooks,
                rules=rules,
                report=DecisionReport(self.metrics, self.reuse, self.feed, lambda: len(self.replicas)),
                rebalancer=self.rebalancer,
                budgets=self.budgets,
                hot_keys=self.hot_keys,
                warmer=self.warmer,
                tracer=tracer,
                room_full=self.room.full if self.room is not None else None,
                queued=self.queue is not None,
                metered=self.budgets is not None,
            )
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
        """Decide where a request goes and record the decision (:meth:`RequestCore.route`); with
        ``queueing.kv_room``, return once its replica has KV room for it."""
        routed = await self.effects.drive(self.core.route(headers, body, timed))
        if self.room is not None:
            try:
                await self.room.hold(routed)
            except BaseException:
                self.release(routed)  # cancelled (its client went away) while it waited
                raise
        return routed

    async def explain(self, headers: Mapping[str, str], body: bytes | None) -> Explanation:
        """The decision :meth:`route` would make for this request now, with its trace, and
        without side effects: nothing is pinned, counted, indexed or refreshed."""
        return await self.effects.drive(explain(self.core, headers, body))

    def release(self, routed: Routed) -> None:
        """The request is over (or abandoned): its in-flight slot is freed, once."""
        self.outcomes.release(routed)
        if self.room is not None:
            self.room.give_back(routed)

    def offer_hot_body(self, features: RequestFeatures, body: bytes | Callable[[], bytes]) -> None:
        """Keep a request of a hot prefix (one per hot key) to warm joining replicas with; ``body``
        may be a function that builds it, called only when one is wanted (the simulator's)."""
        if self.warmer is not None:
            key = self.profiles.for_request(features).prefix_key(features)
            self.warmer.offer(fingerprint(key) if key is not None else None, features.path, body)

    def fleet_saturated(self, pool: tuple[tuple[str, str], ...]) -> bool:
        """Whether every candidate of ``pool`` is saturated now (``queueing:`` thresholds)."""
        return saturated(self.replicas.snapshot(self.clock()), pool, self.config.queueing)

    def _labels_of(self, name: str) -> Mapping[str, str] | None:
        record = self.replicas.record(name)
        return record.replica.labels if record is not None else None

    def _prewarm(self, name: str, path: str, body: bytes) -> bool:
        record = self.replicas.record(name)
        return record is not None and self.rebalancer.prewarmer.submit(record.replica.address, path, body, force=True)

    # -- what comes back ----------------------------------------------------------------------
    def engine_rates(self) -> dict[str, EngineRates]:
        """Every replica's engine speeds: learnt where its answers were observed alone, else its
        pool's prior (``health.engine_rates``)."""
        return {
            rec.replica.name: self.rates.rates(rec.replica.name, rec.replica.labels) for rec in self.replicas.records()
        }

    def latency_view(self) -> LatencyView:
        """The latency models' fits, with the engine rates and the models' output lengths learnt
        so far for the price."""
        view = self.latency.view()
        learned, outputs = self.rates.learned(), self.outputs.view()
        return replace(view, rates=learned, output_tokens=outputs) if learned or outputs else view

    def _labels(self, name: str) -> Mapping[str, str]:
        rec = self.replicas.record(name)
        return rec.replica.labels if rec is not None else {}
