"""What routing a request changes, and undoes: one hook per kind of bookkeeping.

A decision sends a request somewhere; from then until it ends, the router counts it there. Each
hook keeps one account: the replica's load (requests, prefill and KV tokens in flight), what the
replica's cache holds (its prompt in flight, the KV events' credit, the claim its hit counters
later judge), the tenant's requests in flight. Each hook is told when the request is decided, when
its first token came back (its prefill is over: see ``Routed.timed``) and when it ended; the last is called once,
whatever ended it (the response, a reset stream, a refused request). The store's pin and prefix
index are written by the router itself: that step is I/O and may fail.

A disaggregated request (its decision names a prefill replica) is counted on both replicas: on
the decode replica as any request (its KV, the part of the prompt it lacks), and on the prefill
replica as a :class:`PrefillHop`: the tokens it computes are pending there, its prompt in flight
there, until the decode replica's first byte, the only one the router sees (the sidecar makes
the hop behind it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.fleet.cache import ReplicaCaches
from extproc.fleet.health.latency import LatencyBook
from extproc.fleet.health.rates import RateBook
from extproc.fleet.health.replicas import ReplicaBook
from extproc.fleet.queueing import Refusal
from extproc.fleet.queueing.kv_room import Entry
from extproc.observe.tracing import InferenceSpan
from extproc.request.features import RequestFeatures
from extproc.request.splits import Arm
from extproc.routing.latency import LoadPoint
from extproc.routing.model import AffinityView, Decision
from extproc.state.budgets import Admission
from extproc.state.tenancy import TenantLedger


@dataclass(slots=True)
class PrefillHop:
    """What a disaggregated request is counted for on its prefill replica until its first byte."""

    replica: str
    tokens: int = 0
    """Prompt tokens not believed cached there: what it computes, pending there."""
    matched_blocks: int = 0
    """Prompt blocks believed held there (its prompt is in flight there meanwhile)."""
    claimed_tokens: int = 0
    """Prompt tokens the prefix index claimed cached there, for its hit counters to judge."""
    over: bool = False
    """The first byte came back, or the request ended: nothing is counted there any more."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What the router answered for one request: where it goes, or why not, and what is sent.
    Given once by the request core, never changed after; what the request's life writes is its
    :class:`Routed` ledger."""

    features: RequestFeatures
    decision: Decision
    arm: Arm | None = None
    """The split arm the request landed in, if a ``splits:`` rule took it."""
    body: bytes | None = None
    """The body rewritten for its arm (its model replaced), to send instead of the client's."""
    refusal: Refusal | None = None
    """Held while the fleet was full and refused (queue full, or waited past its class's limit)."""
    strip_usage: bool = False
    """The router asked the stream for its usage: the client did not, so that chunk is taken out."""
    objective_wait: AffinityView | None = None
    """Every candidate was predicted to miss its objectives and its class queues on a miss: the
    store's view it was decided on, to judge again while it waits. Nothing is counted for it."""
    room_wait: frozenset[str] | None = None
    """A new conversation every replica it may go to is full for (``queueing.kv_room``): the
    replicas to wait for room on, to be decided among when one has it. Nothing is counted for it."""


@dataclass(slots=True)
class Routed:
    """One routed request: the router's :class:`Answer`, when it was decided, and the ledger of
    its life until it ends (what is counted for it, what came back), written by the bookkeeping
    hooks, the outcomes and the charges."""

    answer: Answer
    decided_at: float
    prefill_tokens: int = 0
    """Prompt tokens not believed cached on the replica, pending there until its first token."""
    released: bool = False
    tenant_counted: bool = False
    kv_tokens: int = 0
    """KV tokens the request was counted as holding on its replica while in flight."""
    claimed_tokens: int = 0
    """Prompt tokens the prefix index claimed cached on the chosen replica (before trust), handed to
    the cache estimate once the prefill is done: the replica counts its hits when it prefills,
    and behind a queue that is seconds after the decision."""
    sent_tokens: int = 0
    """The prompt's tokens, handed to the cache estimate with the claim: the share of them the
    replica's query counter covers says how much of the claim its hits bear on."""
    load_point: LoadPoint | None = None
    """What its replica's latency models learn its latencies against (None: nothing to learn,
    e.g. its answer was another replica's)."""
    answered_at: float | None = None
    """When its first token came back, as far as the router knows: the first streamed event that
    carried one, or for a non-streamed answer its headers less the engine's decode time; without
    a timed body (see ``timed``), its response headers."""
    first_token_seen: bool = False
    """``answered_at`` is its first token's time (measured from the body, or for a non-streamed
    answer estimated from the engine's report), not merely its headers': what latencies learn
    and objectives judge."""
    first_token_estimated: bool = False
    """A non-streamed answer's first token was placed with the replica's decode step rather than
    the engine's reported gap (none reported yet): judged against its objectives, not learnt from."""
    tpot_s: float | None = None
    """Its time per output token after the first, once over: the stream's last token less its
    first over the output tokens less one (the tokens the engine reported, else the events
    counted); for a non-streamed answer the engine's mean inter-token gap. None: not known."""
    timed: bool = False
    """Its response body is read for when its tokens came: its first token, not its headers, ends
    its prefill for the hooks."""
    headers_at: float | None = None
    """When its response headers were seen."""
    tries: int = 1
    """Envoy's tries for it, as its response headers said (more than one: a retry or a hedge)."""
    status: int = 0
    """The response's status, once its headers were seen (0: not seen, or no answer)."""
    arrived_at: float | None = None
    """When the router was first given it (before any wait in its queue): the client's clock for
    its objectives. None: when it was decided."""
    trace: InferenceSpan | None = None
    """Its call to the replica, when traced: the span open until it is over, and the W3C trace
    context handed to the replica."""
    budget: Admission | None = None
    """The request's token budgets (tenant, API key, model) as it was admitted (its estimate
    reserved), until charged or given back."""
    hop: PrefillHop | None = None
    """The prefill hop, when the decision disaggregates the request (``decision.prefill``)."""
    room: Entry | None = None
    """Its claim on its replica's KV room (``queueing.kv_room``), given back when it is over."""

    # The answer's parts, read where the request's life needs them.
    @property
    def features(self) -> RequestFeatures:
        return self.answer.features

    @property
    def decision(self) -> Decision:
        return self.answer.decision

    @property
    def arm(self) -> Arm | None:
        return self.answer.arm

    @property
    def refusal(self) -> Refusal | None:
        return self.answer.refusal

    @property
    def objective_wait(self) -> AffinityView | None:
        return self.answer.objective_wait


class Hook(Protocol):
    """One account kept for every routed request that has a replica."""

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """The request was sent to ``replica`` at ``now``."""
        ...

    def answered(self, routed: Routed, replica: str) -> None:
        """Its first token came back (or, its body not timed, its headers): the prefill there is over."""
        ...

    def ended(self, routed: Routed, replica: str) -> None:
        """It is over (or abandoned); called once."""
        ...


class LoadHook:
    """The replica's requests, pending prefill and KV tokens in flight (the load the decision
    reads before a scrape catches up)."""

    def __init__(self, book: ReplicaBook, clock: Callable[[], float]) -> None:
        self.book = book
        self.clock = clock

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Count it: what it adds to the replica's KV is the part not believed cached (a shared
        prefix is held once, however many requests use it)."""
        features = routed.features
        hold = features.hints.kv_retention_s  # an agent keeps its KV across a tool call
        chain = features.conversation
        opening = chain is not None and chain.match == "new"  # keyless, no assistant turn: maybe a one-off
        self.book.begin(replica, now, routed.prefill_tokens, routed.kv_tokens, features.session_key, hold, not opening)
        if routed.hop is not None:
            self.book.hop(routed.hop.replica, routed.hop.tokens)

    def answered(self, routed: Routed, replica: str) -> None:
        """Its prefill no longer waits (on its prefill replica either)."""
        self.book.prefilled(replica, routed.prefill_tokens)
        routed.prefill_tokens = 0
        self._hop_over(routed)

    def ended(self, routed: Routed, replica: str) -> None:
        """Uncount it."""
        self.book.end(replica, self.clock(), routed.prefill_tokens, routed.kv_tokens, routed.features.session_key)
        routed.prefill_tokens = 0
        self._hop_over(routed)

    def _hop_over(self, routed: Routed) -> None:
        hop = routed.hop
        if hop is not None and hop.tokens:
            self.book.prefilled(hop.replica, hop.tokens)
            hop.tokens = 0


class ObjectiveObserver(Protocol):
    """Where the judgement of each served request's objectives goes (the router's metrics)."""

    def objective_judged(self, request_class: str, met: bool) -> None:
        """A request of ``request_class`` with objectives met them all, or missed one."""
        ...


class ObjectiveHook:
    """Whether a request with latency objectives met them, as the client saw it: its time to first
    token from when the router was given it (its wait in the router's queue included), and its
    time per output token after the first (``Routed.tpot_s``), judged at its end. A response that
    failed misses; a request whose response headers were not seen (a stream reset first), or whose
    first token was not seen when it has a TTFT objective (its body not timed), is not judged;
    a TPOT objective is judged where the TPOT is known."""

    def __init__(self, observer: ObjectiveObserver, clock: Callable[[], float]) -> None:
        self.observer = observer
        self.clock = clock

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Nothing: judged when it ends."""

    def answered(self, routed: Routed, replica: str) -> None:
        """Nothing yet: the first token's time is on ``routed``, judged with the rest at the end."""

    def ended(self, routed: Routed, replica: str) -> None:
        """Judge it, once, if its response headers were seen."""
        f = routed.features
        if routed.headers_at is None or (f.slo_ttft_ms is None and f.slo_tpot_ms is None):
            return
        met = 0 < routed.status < 400
        if met and f.slo_ttft_ms is not None:
            known = routed.first_token_seen or routed.first_token_estimated
            if not known or routed.answered_at is None:
                return  # its first token's time is not known: nothing to judge
            since = routed.arrived_at if routed.arrived_at is not None else routed.decided_at
            met = (routed.answered_at - since) * 1000.0 <= f.slo_ttft_ms
        if met and f.slo_tpot_ms is not None and routed.tpot_s is not None:
            met = routed.tpot_s * 1000.0 <= f.slo_tpot_ms
        self.observer.objective_judged(f.request_class, met)


class LatencyHook:
    """The replica's latency models: its time to first token, then its time per output token
    after the first (``Routed.tpot_s``), each where the router saw it (never from the headers of
    a stream, which vLLM sends before its first token, nor from ``max_tokens``)."""

    def __init__(self, book: LatencyBook, clock: Callable[[], float]) -> None:
        self.book = book
        self.clock = clock

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Nothing: the router notes the load point with the decision."""

    def answered(self, routed: Routed, replica: str) -> None:
        """Learn its time to first token, when that was seen."""
        if routed.load_point is not None and routed.answered_at is not None and routed.first_token_seen:
            self.book.observe_ttft(replica, routed.load_point, routed.answered_at - routed.decided_at)

    def ended(self, routed: Routed, replica: str) -> None:
        """Learn its time per output token, when it is known."""
        if routed.load_point is not None and routed.first_token_seen and routed.tpot_s is not None:
            self.book.observe_tpot(replica, routed.load_point, routed.tpot_s)


class RateHook:
    """The replica's engine speeds (:mod:`extproc.fleet.health.rates`): its cold prefill rate from the
    time to first token of a request it served alone, its decode step from that request's time
    per output token."""

    def __init__(self, book: RateBook, labels: Callable[[str], Mapping[str, str]]) -> None:
        self.book = book
        self.labels = labels

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Nothing: the load point is noted with the decision."""

    def answered(self, routed: Routed, replica: str) -> None:
        """Its time to first token, when that was seen."""
        if routed.load_point is not None and routed.answered_at is not None and routed.first_token_seen:
            seconds = routed.answered_at - routed.decided_at
            self.book.observe_ttft(replica, self.labels(replica), routed.load_point, seconds)

    def ended(self, routed: Routed, replica: str) -> None:
        """Its time per output token, when it is known (a stream's)."""
        if routed.load_point is not None and routed.tpot_s is not None and routed.features.stream:
            self.book.observe_tpot(replica, self.labels(replica), routed.load_point, routed.tpot_s)


class CacheHook:
    """What the replica's cache holds: the prompt in flight there, the KV events' credit, and the
    claim its hit counters judge once the prefill is done."""

    def __init__(self, caches: ReplicaCaches) -> None:
        self.caches = caches

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Its prompt is in flight there (and on its prefill replica, which computes it)."""
        self.caches.sent(replica, routed.features, routed.decision.matched_blocks, now)
        if routed.hop is not None:
            self.caches.sent(routed.hop.replica, routed.features, routed.hop.matched_blocks, now)

    def answered(self, routed: Routed, replica: str) -> None:
        """Its claim is weighed against the hits the replica reports from now on; its prefill
        replica is done with it."""
        self._settle(routed, replica)
        self._hop_over(routed)

    def ended(self, routed: Routed, replica: str) -> None:
        """Its prompt is no longer in flight (its claim settled if no first byte was seen)."""
        self._settle(routed, replica)
        self.caches.ended(replica, routed.features)
        self._hop_over(routed)

    def _settle(self, routed: Routed, replica: str) -> None:
        if routed.claimed_tokens or routed.sent_tokens:
            self.caches.prefilled(replica, routed.claimed_tokens, routed.sent_tokens)
            routed.claimed_tokens = routed.sent_tokens = 0

    def _hop_over(self, routed: Routed) -> None:
        hop = routed.hop
        if hop is None or hop.over:
            return
        hop.over = True
        # The prefill replica computed the whole prompt but what it held: its hit counters judge
        # the index's claim there as they do on any replica.
        self.caches.prefilled(hop.replica, hop.claimed_tokens, routed.features.estimated_prompt_tokens)
        self.caches.ended(hop.replica, routed.features)


class TenantHook:
    """The tenant's requests in flight (its quota and its share of each replica)."""

    def __init__(self, ledger: TenantLedger) -> None:
        self.ledger = ledger

    def decided(self, routed: Routed, replica: str, now: float) -> None:
        """Count it, for tenants with a policy."""
        routed.tenant_counted = self.ledger.begin(routed.features.tenant, replica)

    def answered(self, routed: Routed, replica: str) -> None:
        """Nothing: a tenant's request counts until it ends."""

    def ended(self, routed: Routed, replica: str) -> None:
        """Uncount it."""
        if routed.tenant_counted:
            self.ledger.end(routed.features.tenant, replica)


def decided(hooks: Sequence[Hook], routed: Routed, now: float) -> None:
    """Tell every hook ``routed`` was decided (nothing for a request without a replica)."""
    replica = routed.decision.replica
    if replica is not None:
        for hook in hooks:
            hook.decided(routed, replica.name, now)


def answered(hooks: Sequence[Hook], routed: Routed) -> None:
    """Tell every hook ``routed``'s first token came back."""
    replica = routed.decision.replica
    if replica is not None and not routed.released:
        for hook in hooks:
            hook.answered(routed, replica.name)


def ended(hooks: Sequence[Hook], routed: Routed) -> bool:
    """Tell every hook ``routed`` is over, once; False when it was already (or had no replica)."""
    replica = routed.decision.replica
    if routed.released or replica is None:
        return False
    routed.released = True
    for hook in hooks:
        hook.ended(routed, replica.name)
    return True
