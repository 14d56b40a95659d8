"""The values the decision works on: replicas as last known, what the store remembers, the decision."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from extproc.routing.roles import PairReason, Role, role_of

WAITING_REQUEST_TOKENS = 256
"""The prompt tokens a request the engine reports waiting (:attr:`ReplicaState.queue`) is assumed
to bring when nothing says more: what the overload filter and the price both weigh it at."""


@dataclass(frozen=True, slots=True)
class Replica:
    """A model server the router can send to. In cluster mode ``name`` is its Envoy cluster."""

    name: str
    address: str
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    role: Role = field(init=False, repr=False, compare=False)
    """Its part in disaggregated serving, from its labels (:mod:`extproc.routing.roles`): read once,
    since every decision asks it of every candidate."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", role_of(self.labels))


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica's health and load as last known (from scrapes and from observed traffic)."""

    replica: Replica
    in_rotation: bool = True
    health: float = 1.0
    inflight: int = 0
    inflight_tokens: int = 0
    """KV the requests in flight there added: their prompts' parts not believed cached before."""
    pending_prefill_tokens: int = 0
    live_sessions: float = 0.0
    """Conversations live there and expected to come back with their next turns: a turn in flight,
    or one begun within the last minute; a keyless request that opened one and has not come back
    counts at the rate such openings come back (a one-off leaves nothing to come), as
    :class:`~extproc.fleet.health.sessions.LiveSessions` counts it."""
    live_session_tokens: int = 0
    """The KV of their own that those conversations added there: each turn's prompt tokens not
    believed cached when it was sent (a prefix they share is counted once, by whoever brought it),
    counted from the moment a conversation is placed: in full for a declared one (a session key)
    or one that came back, at the recent keyless openings' return rate for a keyless request that
    opened one and has not come back (:class:`~extproc.fleet.health.sessions.LiveSessions`)."""
    working_set_tokens: int = 0
    """The KV of their own that the conversations due back there hold
    (:class:`~extproc.fleet.health.working_sets.WorkingSets`)."""
    recent_requests: float = 0.0
    queue: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int = 0
    """The replica's KV cache in tokens (``vllm:cache_config_info``), 0 while unknown."""
    cache_fill: float = 1.0
    """How full its prefix cache is believed to be, in [0, 1]: the uncached prompt tokens this
    gateway sent there over the cache's size. Full (1) while the size is unknown, and once the
    cache has taken its size: a fill of 1 everywhere tells nothing apart. It starts empty when the
    router starts, whatever the engine held before."""
    adapters: frozenset[str] = frozenset()
    adapters_waiting: frozenset[str] = frozenset()
    max_lora: int = 0
    models: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        """The replica's name."""
        return self.replica.name

    @property
    def role(self) -> Role:
        """Its part in disaggregated serving, from its labels (:mod:`extproc.routing.roles`)."""
        return self.replica.role

    def work(self, tokens_per_request: int) -> int:
        """Outstanding work in prompt-token equivalents: prefills not yet answered, plus a fixed
        cost per request in flight or queued (its decode)."""
        return self.pending_prefill_tokens + tokens_per_request * (self.inflight + self.queue)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All replicas' states at one moment; the decision never sees anything fresher."""

    replicas: tuple[ReplicaState, ...]
    tenant_inflight: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(tenant, replica) -> requests in flight, for tenants with quotas."""

    def get(self, name: str) -> ReplicaState | None:
        """The state of replica ``name``, if it is a member."""
        for state in self.replicas:
            if state.name == name:
                return state
        return None


@dataclass(frozen=True, slots=True)
class TenantTerms:
    """What the tenant ledger says of a request's tenant, as an input of the decision.

    The ledger counts (it has state); the decision applies the terms (it has none): a tenant over
    its quota is refused or sent to the overflow pool, one with a shard is confined to it.
    """

    over_quota: bool = False
    over_quota_action: Literal["reject", "overflow"] = "reject"
    overflow_pool: tuple[tuple[str, str], ...] = ()
    retry_after_s: int = 1
    shard_size: int = 0


NO_TERMS = TenantTerms()
"""A tenant without a policy: no quota, no shard."""


@dataclass(frozen=True, slots=True)
class AffinityView:
    """What the affinity store knows for one request."""

    pinned: str | None = None
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    pin_lost: str | None = None
    """What says the pinned replica no longer holds the conversation: ``"kv_events"`` (its own
    events show the blocks evicted), ``"hit_counters"`` (it reports misses on what was sent there,
    and the index no longer claims the prompt) or ``"capacity"`` (its counters bear the index out,
    and the index, bounded by the cache size it reports, has evicted the prompt); None while
    nothing does. Without such evidence a pin keeps its full value: a match the index forgot
    while the replica never counted is no proof of loss."""


class Reason(enum.StrEnum):
    """Why a request went where it went (also a metric label: keep the set small)."""

    STICKY = "sticky"
    EVICTED = "evicted"
    """The pinned replica was a candidate, but had lost the conversation (``AffinityView.pin_lost``)
    and another replica outweighed staying."""
    PREFIX = "prefix"
    NEW_SESSION = "new_session"
    SPILLOVER = "spillover"
    FAILOVER = "failover"
    FALLBACK = "fallback"
    NO_REPLICA = "no_replica"
    QUOTA = "quota"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, where it may go instead, and why."""

    replica: Replica | None
    reason: Reason
    fallbacks: tuple[Replica, ...] = ()
    matched_blocks: int = 0
    total_blocks: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)
    pin: bool = True
    """Whether the session is (re-)pinned to ``replica``: not after a spillover, unless the profile
    re-pins them."""
    retry_after_s: int | None = None
    """For a refusal (``quota``): when the client may try again."""
    hot_set: tuple[str, ...] = ()
    """The replicas serving the request's prefix, when it is hot (:mod:`extproc.routing.hot`)."""
    moved_by: str = ""
    """For a session sent off its pinned replica: what did it (the filter that removed the pin,
    ``"membership"`` when the replica is gone, the evidence of ``AffinityView.pin_lost`` when it was
    outscored, ``"scores"`` otherwise); empty when the session stayed or had no pin."""
    objective_missed: bool = False
    """The request has latency objectives and every candidate left is predicted, by a warm latency
    model, to miss them (:func:`extproc.routing.slo.best_headroom` below 0); what then
    becomes of it is its class's ``on_miss``, the router's to carry out."""
    objective_headroom: float | None = None
    """The most headroom any candidate is predicted to leave of the request's objectives (a share
    of them, negative when late), when every candidate has a warm model for them; None otherwise.
    A class's ``admit_margin`` is judged on it."""
    prefill: Replica | None = None
    """The replica that prefills the prompt for ``replica`` (the decode replica), when the pair is
    disaggregated (:mod:`extproc.routing.disagg`); None: ``replica`` serves the whole request."""
    pair: PairReason | None = None
    """Why the pair is what it is, for fleets whose candidates carry roles; None for an aggregated
    fleet (no replica labelled ``llm-d.ai/role`` prefill or decode)."""
    transfer_blocks: int = 0
    """KV blocks that cross from ``prefill`` to ``replica`` (0 without a prefill hop)."""


def cache_fill(written_tokens: float, capacity_tokens: int) -> float:
    """:attr:`ReplicaState.cache_fill` of a cache of ``capacity_tokens`` (0: unknown, full) into
    which ``written_tokens`` uncached tokens were written: vLLM frees a block only to reuse it, so
    a cache that took as many tokens as it holds stays full."""
    return min(1.0, written_tokens / capacity_tokens) if capacity_tokens > 0 else 1.0


def working_set_overflow(state: ReplicaState, own: int, pinned: str | None = None) -> float:
    """What placing a conversation whose history is ``own`` tokens on ``state`` is expected to
    make its next turns and its neighbours' recompute, in tokens. The cache keeps the histories due
    back there (:attr:`ReplicaState.working_set_tokens`, less the conversation's own where it is
    ``pinned`` there) only while they fit it together: an LRU cache then loses each before its next
    turn.

    - They fit beside it: nothing.
    - They fit, but not with it: its history at the share by which it does not fit, and theirs at
      that share too (it tips the cache into losing them).
    - They overflow the cache already: its own history, times the cache over what is due back.
      Nothing more is lost there, and the fuller such a cache, the less one more conversation
      costs, so that the overflow gathers on as few replicas as possible while the others drain
      back under their caches (real vLLM at 36 conversations / 18 live: 34.3% hit ratio over
      thirteen runs, against 32.2% over twelve with its own history at full cost on every
      overflowing replica; in the same rounds 2.8 points apart, standard error 2.6;
      benchmarks/realstack-vllm.md).

    0 where the cache's size is unknown."""
    capacity = state.kv_capacity_tokens
    if capacity <= 0 or own <= 0:
        return 0.0
    others = max(0, state.working_set_tokens - (own if state.name == pinned else 0))
    overflow = others + own - capacity
    if overflow <= 0:
        return 0.0
    if others > capacity:
        return own * capacity / others
    return overflow / own * (own + others)  # others fit: the overflow is at most its own history
