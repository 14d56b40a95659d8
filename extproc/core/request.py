"""The request core: one request, from its headers and body to where it goes, with no I/O.

:meth:`RequestCore.route` is the whole path of a request, as a generator of effects
(:mod:`extproc.core.effects`): read once (features and its parsed body), it may take a split's
arm, is named a conversation, hashed (over its model's tokens where a tokenizer serves it), meets
the admission rules (:mod:`extproc.core.admission`), and is placed (:meth:`RequestCore.place`):
decided on one set of inputs (:meth:`RequestCore.inputs`: the store's view weighed by what the
replicas report, their health and load, the tenant's terms, the cordons, the hot prefixes),
judged against its objectives, counted where it went (the bookkeeping hooks) and recorded.

The processor drives it on the event loop (:meth:`Effects.drive`), the simulator without one
(:meth:`Effects.drive_now`), entering at :meth:`RequestCore.place` with features it made itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from extproc.config import Config
from extproc.core.admission import SPENDING_REFUSALS, AdmissionRule, Admitted, ObjectiveVerdict, admit
from extproc.core.bookkeeping import Answer, Hook, PrefillHop, Routed, decided
from extproc.core.effects import AwaitRoom, Hold, Identify, Lookup, Record, Steps, Tokenize
from extproc.core.report import DecisionReport
from extproc.core.rewriting import name_response, split
from extproc.fleet.cache import CacheView, ReplicaCaches
from extproc.fleet.health.latency import LatencyBook
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing import Refusal
from extproc.fleet.queueing.kv_room import Entry
from extproc.fleet.rebalance.rebalancer import Rebalancer
from extproc.observe.hotkeys.detector import HotKeyDetector
from extproc.observe.hotkeys.warming import HotKeyWarmer
from extproc.observe.metrics import RouterMetrics
from extproc.observe.tracing import DecisionTracer
from extproc.request.agent_apis import RESPONSES_PATH
from extproc.request.features import (
    CHARS_PER_TOKEN,
    ParsedRequest,
    RequestFeatures,
    read_request,
    uncached_tokens,
    with_block_hashes,
    with_chain,
)
from extproc.request.openai_body import USAGE_ASKED_PATHS
from extproc.request.splits import Arm, encode_body
from extproc.request.usage import ask_for_usage
from extproc.routing.cordon import FULL
from extproc.routing.hot import fingerprint
from extproc.routing.latency import LatencyView, LoadPoint
from extproc.routing.model import AffinityView, Decision, Reason
from extproc.routing.pipeline import Decider, DecisionInputs, Profiles
from extproc.state.budgets import BudgetLedger
from extproc.state.tenancy import TenantLedger

log = logging.getLogger("extproc.app.router")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request read and made ready to route: its features (named and hashed), the body sent
    instead of the client's (None: the client's), and what the rewrite changed."""

    features: RequestFeatures
    sent: bytes | None
    """A usable body, as it is sent (the rewritten one, else the client's): a hot prefix's exemplar."""
    rewritten: bytes | None
    arm: Arm | None
    strip_usage: bool


@dataclass(frozen=True, slots=True)
class CoreParts:
    """What the core reads and counts on: the router's collaborators, wired once."""

    config: Config
    clock: Callable[[], float]
    wall: Callable[[], float]
    metrics: RouterMetrics
    replicas: ReplicaBook
    caches: ReplicaCaches
    tenants: TenantLedger
    profiles: Profiles
    decide: Decider
    latency: LatencyBook
    latency_view: Callable[[], LatencyView]
    cordons: Callable[[], Mapping[str, str]]
    hooks: tuple[Hook, ...]
    rules: tuple[AdmissionRule, ...]
    report: DecisionReport
    rebalancer: Rebalancer
    budgets: BudgetLedger | None = None
    hot_keys: HotKeyDetector | None = None
    warmer: HotKeyWarmer | None = None
    tracer: DecisionTracer | None = None
    room_full: Callable[[RequestFeatures], frozenset[str]] | None = None
    """``queueing.kv_room``: the replicas a new conversation would wait for KV room on now."""
    queued: bool = False
    """The fair queue is on: a class that queues on a predicted miss may be held for its objectives."""
    metered: bool = False
    """Budgets are on: every response's usage is read, so a stream is asked to report it."""


class RequestCore:
    """Routes one request at a time as a generator of effects; holds no state of its own."""

    def __init__(self, parts: CoreParts) -> None:
        self.p = parts
        self.verdict = ObjectiveVerdict(parts.config)
        self.pairing = parts.config.disaggregation.pair_settings(parts.config.features.block_chars // CHARS_PER_TOKEN)
        self._learn_on_objective = parts.config.health.latency_models == "auto"

    # -- the whole path -----------------------------------------------------------------------
    def route(self, headers: Mapping[str, str], body: bytes | None, timed: bool = False) -> Steps[Routed]:
        """Decide where a request goes and record the decision (pin, prefix index, in-flight).
        ``timed``: its response body will be read for when its tokens came, so a stream is asked
        for the usage it reports (its output tokens; the chunk is taken out again for a client
        that did not ask)."""
        p = self.p
        start, started_ns = p.clock(), int(p.wall() * 1e9)
        arrived = start
        prepared = yield from self.prepare(headers, body, timed, start)
        features = prepared.features
        admitted = Admitted()
        refusal = yield from admit(p.rules, features, headers, admitted)
        if refusal is not None:
            return self._refused(features, refusal, admitted, prepared.arm)
        if admitted.held:
            start = p.clock()  # the decision is made now, on the load as it is now
        try:
            routed = yield from self.place(features, start, prepared.sent, may_wait=admitted.held)
        finally:
            for ticket in admitted.tickets:
                ticket.settle()
        if routed.objective_wait is not None and p.queued:
            # Every candidate is predicted to miss and the class queues: wait until one is predicted
            # to meet them (or the fleet is idle), then decide again and go wherever that says.
            ready = self.objective_ready(features, routed.objective_wait)
            hold = Hold(features.request_class, features.tenant, features.pool, features.hints.demotion, ready)
            held = yield hold
            if isinstance(held, Refusal):
                return self._refused(features, held, admitted, prepared.arm)
            start = p.clock()
            try:
                routed = yield from self.place(features, start, prepared.sent)
            finally:
                if held is not None:
                    held.settle()
        if routed.answer.room_wait is not None:
            # A new conversation with no room anywhere it may go: decided among them once one has.
            room = yield AwaitRoom(features, routed.answer.room_wait)
            routed = yield from self.place(features, p.clock(), prepared.sent, room=room)
            routed.room = room
        routed.arrived_at = arrived
        # The answer complete, before anyone outside the core sees it: never changed after (most
        # requests change nothing in it, and a dataclass replace is a few microseconds).
        answer = routed.answer
        if (answer.arm, answer.body, answer.strip_usage) != (prepared.arm, prepared.rewritten, prepared.strip_usage):
            routed.answer = replace(answer, arm=prepared.arm, body=prepared.rewritten, strip_usage=prepared.strip_usage)
        routed.budget = admitted.budget
        if p.tracer is not None:
            profile = p.profiles.for_request(features).name
            routed.trace = p.tracer.decided(headers, features, routed.decision, started_ns, len(p.replicas), profile)
        if prepared.arm is not None:
            p.metrics.split_requests.labels(prepared.arm.rule, prepared.arm.label).inc()
        replica = routed.decision.replica
        if features.session_key and prepared.sent and replica is not None:
            hashes = features.prefix_hashes  # kept: a move indexes the session in this key space
            p.rebalancer.note(
                features.session_key, features.model, replica.name, features.path, prepared.sent, start, hashes
            )
        return routed

    def prepare(self, headers: Mapping[str, str], body: bytes | None, timed: bool, now: float) -> Steps[Prepared]:
        """Read the request once: its split's arm, a Responses request's name, the usage asked
        for, its body rewritten once whatever changed it; then its conversation and its hashes
        (once the model served and the tokenizer's part are known: each hash once)."""
        p = self.p
        request = read_request(headers, body, p.config.features, hashed=False)
        if request.features.body_error is not None and body is not None:
            p.metrics.body_errors.inc()
        arm, changed, strip_usage = None, False, False
        if p.config.splits and request.body is not None:
            request, arm, changed = split(p.config, headers, request)
        if request.features.path == RESPONSES_PATH and request.body is not None:
            request, named = name_response(p.config, headers, request)
            changed = changed or named
        asking = request.features.path in USAGE_ASKED_PATHS  # the agent APIs' streams always report
        if (p.metered or timed) and request.body is not None and asking:
            asked = ask_for_usage(request.body.body)  # so that a stream reports what it used
            if asked is not None:
                request = ParsedRequest(request.features, replace(request.body, body=asked))
                changed = strip_usage = True
        rewritten = encode_body(request.body.body) if changed and request.body is not None else None
        request = with_chain(request, p.config.features)
        features = yield Identify(request.features, now)
        if features.conversation is not None and features.conversation.match is not None:
            p.metrics.conversations.labels(features.conversation.match).inc()
        features = yield from self.hashed(features, request)
        sent = (rewritten or body) if request.body is not None else None
        return Prepared(features, sent, rewritten, arm, strip_usage)

    def hashed(self, features: RequestFeatures, request: ParsedRequest) -> Steps[RequestFeatures]:
        """``features`` with its prompt's block keys: the tokenizer's where one serves its model,
        else character blocks (computed only then)."""
        features = yield Tokenize(features, request.body.body if request.body else None)
        return with_block_hashes(features, request.body, self.p.config.features)

    def _refused(self, features: RequestFeatures, refusal: Refusal, admitted: Admitted, arm: Arm | None) -> Routed:
        """A request an admission rule refused: a budget's refusal keeps its admission (its
        ``x-ratelimit-*`` answer); one refused later gives its reservation back."""
        p = self.p
        p.metrics.shed(features.request_class, refusal.kind)
        if refusal.kind in SPENDING_REFUSALS:
            quota = Answer(features, Decision(None, Reason.QUOTA), refusal=refusal)
            return Routed(quota, p.clock(), budget=admitted.budget)
        if p.budgets is not None and admitted.budget is not None:
            p.budgets.release(admitted.budget)
        return Routed(Answer(features, Decision(None, Reason.NO_REPLICA), arm=arm, refusal=refusal), p.clock())

    # -- the decision -------------------------------------------------------------------------
    def place(
        self,
        features: RequestFeatures,
        start: float,
        body: bytes | None = None,
        *,
        may_wait: bool = False,
        room: Entry | None = None,
    ) -> Steps[Routed]:
        """Decide on the inputs as they are at ``start``, count the request where it went, record
        its pin and prefix; ``body`` (a usable one) is kept as a hot prefix's exemplar if wanted.
        A request every candidate is predicted to miss goes as its class's ``on_miss`` says: shed
        (refused, nothing counted), held (``may_wait``: returned unrouted with ``objective_wait``,
        nothing counted) or routed as decided. A new conversation goes where there is KV room for
        it (``queueing.kv_room``), with none anywhere is returned to wait (``room_wait``, nothing
        counted), then placed again where ``room`` was given."""
        p = self.p
        stored: AffinityView = yield Lookup(features, start)
        p.caches.refresh(start)
        given, cached = self.inputs(features, stored, start)
        given, full = self.room_marked(given, room)
        fp = None  # the prefix key's fingerprint, once a request, where hot keys are on
        if p.hot_keys is not None:
            fp = fingerprint(given.prefix_key) if given.prefix_key is not None else None
            p.hot_keys.observe_fingerprint(fp, features.prompt_chars // CHARS_PER_TOKEN, start)
            given = replace(given, hot=p.hot_keys.table(), prefix_fingerprint=fp)
        decision = p.decide(given)
        if decision.reason is Reason.QUOTA:
            p.metrics.shed(features.request_class, "quota_exceeded")
        elif self.verdict.misses(features, decision):
            unrouted = self._missed(features, stored, start, may_wait)
            if unrouted is not None:
                return unrouted
        if room is None and decision.replica is not None and decision.replica.name in full:
            among = full.difference(p.cordons())  # an operator's cordon: no room to wait for there
            if among:
                return Routed(Answer(features, Decision(None, Reason.NO_REPLICA), room_wait=among), start)
        routed = Routed(Answer(features, decision), start)
        replica = decision.replica
        if replica is not None:
            self._count(routed, given, cached)
            decided(p.hooks, routed, start)
            if p.warmer is not None:
                matches, total = given.view.prefix_matches, len(features.prefix_hashes)
                p.warmer.widened(fp, decision.hot_set, replica.name, matches, total)
            prefill = decision.prefill.name if decision.prefill is not None else None
            yield Record(features, replica.name, start, decision.pin, prefill)
        if p.warmer is not None and body:
            p.warmer.offer(fp, features.path, body)
        routed.decided_at = p.clock()
        p.report.decided(features, decision, given.view, start, routed.decided_at)
        return routed

    def room_marked(self, given: DecisionInputs, room: Entry | None = None) -> tuple[DecisionInputs, frozenset[str]]:
        """``given`` with the replicas a new conversation may not go to for want of KV room marked
        (``queueing.kv_room``), and those replicas: the ones full for it now, or all but the one
        that gave it room after its wait (none once its wait ran out). A conversation whose
        replica is known to have lost it (``pin_lost``) is a new one here, unless that replica
        stores it (a Responses chain: anywhere else is a 404)."""
        view, chain = given.view, given.features.conversation
        kept = view.pin_lost is None or (chain is not None and chain.stored)
        if self.p.room_full is None or (view.pinned is not None and kept):
            return given, frozenset()
        if room is None:
            full = self.p.room_full(given.features)
        elif room.inside:
            full = frozenset(s.name for s in given.snapshot.replicas if s.name != room.replica)
        else:
            return given, frozenset()
        if full:  # an operator's cordon stands over the room's
            given = replace(given, cordons={**dict.fromkeys(full, FULL), **(given.cordons or {})})
        return given, full

    def _count(self, routed: Routed, given: DecisionInputs, cached: CacheView) -> None:
        """What a routed request is counted for where it goes (its prefill, its KV, the claim)."""
        p, features, decision = self.p, routed.features, routed.decision
        assert decision.replica is not None
        replica = decision.replica
        block_chars = p.config.features.block_chars
        routed.prefill_tokens = routed.kv_tokens = uncached_tokens(features, decision.matched_blocks, block_chars)
        routed.sent_tokens = features.estimated_prompt_tokens
        claimed = cached.claims.get(replica.name, 0)
        routed.claimed_tokens = routed.sent_tokens - uncached_tokens(features, claimed, block_chars)
        if decision.prefill is not None:
            routed.hop = self._hop(features, decision.prefill.name, given.view, cached)
            routed.prefill_tokens = 0  # the decode replica takes the prompt's blocks, computes none
        if self._learn_on_objective and (features.slo_ttft_ms is not None or features.slo_tpot_ms is not None):
            p.latency.wanted()
        state = given.snapshot.get(replica.name)
        # A hop's first byte is two replicas' work: not the decode replica's latency to learn.
        if state is not None and routed.hop is None and p.latency.learning:
            routed.load_point = LoadPoint.of(state, routed.prefill_tokens)

    def _missed(self, features: RequestFeatures, stored: AffinityView, now: float, may_wait: bool) -> Routed | None:
        """A request every candidate is predicted to miss: refused if its class sheds, returned to
        wait if it queues and may, else None (routed best effort)."""
        on_miss = self.verdict.on_miss(features)
        if on_miss == "shed":
            refusal = self.verdict.shed(features)
            self.p.metrics.shed(features.request_class, refusal.kind)
            decision = Decision(None, Reason.NO_REPLICA, retry_after_s=refusal.retry_after_s)
            return Routed(Answer(features, decision, refusal=refusal), now)
        if on_miss == "queue" and may_wait and not self.idle(now):
            return Routed(Answer(features, Decision(None, Reason.NO_REPLICA), objective_wait=stored), now)
        return None

    def idle(self, now: float) -> bool:
        """Nothing in flight anywhere: waiting for load to drain cannot bring an objective closer."""
        return all(max(s.inflight, s.running + s.queue) == 0 for s in self.p.replicas.snapshot(now).replicas)

    def objective_ready(self, features: RequestFeatures, stored: AffinityView) -> Callable[[], bool]:
        """For a request held for its objectives: whether it may go now, judged on the fleet as it
        is (the store's view as it was when it was held): a decision made now would not predict
        a miss, or the fleet has nothing in flight. Nothing is recorded."""

        def ready() -> bool:
            now = self.p.clock()
            try:
                given, _ = self.inputs(features, stored, now)
                return self.idle(now) or not self.verdict.misses(features, self.p.decide(replace(given, record=False)))
            except Exception:  # never hold a request on a failing judgement
                log.exception("judging a held request's objectives failed; releasing it")
                return True

        return ready

    def _hop(self, features: RequestFeatures, name: str, view: AffinityView, cached: CacheView) -> PrefillHop:
        """What a prefill hop to ``name`` is counted for there (:class:`PrefillHop`)."""
        block_chars = self.p.config.features.block_chars
        matched = view.prefix_matches.get(name, 0)
        claimed = features.estimated_prompt_tokens - uncached_tokens(features, cached.claims.get(name, 0), block_chars)
        return PrefillHop(name, uncached_tokens(features, matched, block_chars), matched, claimed)

    def inputs(
        self, features: RequestFeatures, stored: AffinityView, now: float, *, explain: bool = False
    ) -> tuple[DecisionInputs, CacheView]:
        """The decision's inputs for ``features``, from the store's view ``stored``, and the cache
        view they hold (the claims before trust; for Explain, each match's source). The hot table
        is the caller's to add: the request path counts the request first, Explain does not."""
        p = self.p
        cached = p.caches.view(stored, features, now, explain=explain)
        given = DecisionInputs.of(
            features,
            p.replicas.snapshot(now, p.tenants.by_replica),
            cached.view,
            now,
            p.profiles.for_request(features),
            p.tenants.terms(features.tenant, len(p.replicas)),
            cordons=p.cordons(),
            latency=p.latency_view(),
            pairing=self.pairing,
            block_chars=p.config.features.block_chars,
        )
        return given, cached
