"""Other routers as simulation policies, so a benchmark compares them fairly: same request
features, same replica load, same store, same replica models; only the choice differs.

A peer router is a :class:`PeerPolicy`: given the request and the :class:`Fleet` (the replicas
as the router tracks and last scraped them, the store's approximate prefix index), it ranks the
replicas (:meth:`~PeerPolicy.choose`, the choice first), and it is told where the request went
(:meth:`~PeerPolicy.observe`). Whatever a peer remembers (a round-robin counter, an approximate
tree, a seeded generator, a ring) lives in the policy object, and the object belongs to one
simulation run: the simulator builds it, hands the router a :class:`PeerDecision` in place of
:func:`~extproc.api.decide` (``Router(decider=...)``), and calls ``observe`` after
each routed request. The router's plugin registry and its pipeline know nothing of peers, and no
config file can name one.

All of them are policies, the scorer combinations (GIE's default profile, llm-d's precise
prefix-cache profile) included, rather than profiles of our pipeline: their max-score picker
draws ties from a seeded generator (state), llm-d's prefix scorer reads the replicas' true caches
through the simulator's probe (an object no config can give), and one kind of peer keeps the
production registry free of the lab. :class:`MaxScorePolicy` weighs their scorers the way the
pipeline does (each score clamped to [0, 1], weighted, summed) and breaks ties at random.

Each is written from its project's published behaviour (the projects' documentation and
published benchmarks), not from their code:

- ``round_robin``, ``random``, ``least_request``, ``power_of_two`` (vllm-router, sglang-router,
  Envoy): over all replicas. Randomness comes from a generator seeded by the benchmark
  (``seed``) or passed in (``rng``), never from the clock.
- ``consistent_hash`` (vllm-router, vLLM production-stack): a ring of 160 virtual nodes per
  replica on the session key (else the request id, as vllm-router falls back to a hash of the
  request), with no load bound.
- ``sglang_cache_aware`` (sglang-router): an approximate tree of what it sent where; if the
  in-flight spread is over ``balance_abs_threshold`` and ``balance_rel_threshold`` times the
  least, the least loaded; else the best match if its match rate is over ``cache_threshold``,
  else the replica with the smallest tree.
- ``gie_default`` (Gateway API Inference Extension's default profile): queue 2, kv-cache 2,
  prefix 3, highest total, ties broken at random.
- ``dynamo_kv`` (NVIDIA Dynamo's KV router): lowest ``overlap_weight x prefill blocks + decode
  blocks``, the overlap taken from the replicas' real caches (KV events) when a probe is given.
- ``llmd_precise`` (llm-d's precise prefix-cache routing): precise prefix (the longest prefix each
  replica really holds, from KV events, over the best candidate's) 2, GIE's kv-cache utilization
  1 and queue 1, as llm-d's precise-prefix-cache guide configures them; llm-d's load-aware scorer
  (:class:`LoadAwareScorer`) is there to be weighed too.

(The greedy "oracle", the longest true prefix wins, is gone: it herded everything onto one
replica, and ``dynamo_kv`` and ``llmd_precise`` read the true cache and load instead.)
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.api import CHARS_PER_TOKEN, Decision, DecisionInputs, DecisionTrace, Reason, ReplicaState, RequestFeatures
from extproc.api.sim import HashRing, PrefixIndex, ranked_decision


class CacheProbe(Protocol):
    """What the replicas really hold: a simulator's view of their caches, or what a router fed by
    KV events and tracking its own requests knows."""

    def cached_tokens(self, features: RequestFeatures) -> Mapping[str, int]:
        """Cached prompt tokens per replica name (replicas holding none may be omitted)."""
        ...

    def active_blocks(self) -> Mapping[str, int]:
        """KV blocks held by each replica's running requests."""
        ...


@dataclass(frozen=True, slots=True)
class Fleet:
    """What a peer router sees when it chooses: the replicas, with the requests this router has in
    flight on each and their load as last scraped, and the store's approximate prefix index
    (leading blocks of the request believed held, per replica)."""

    replicas: Sequence[ReplicaState]
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    now: float = 0.0


class PeerPolicy(Protocol):
    """Another router's policy, owned by one simulation run."""

    name: str

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """The fleet's replicas ranked for ``request``, the choice first (the rest are fallbacks)."""
        ...

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """``request`` was sent to ``replica``: learn what the router would learn."""
        ...


class PeerScorer(Protocol):
    """One of a scoring peer's scorers: values in [0, 1] per replica (missing: 0)."""

    name: str

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """Scores per replica name."""
        ...


@dataclass(frozen=True)
class PeerDecision:
    """The router's decision step when ``peer`` decides (a :class:`~extproc.api.sim.Decider`):
    the peer ranks all replicas, and the decision states reason, pin and fallbacks as ours would.
    A peer is another router: it knows nothing of our tenants' quotas or of cordons."""

    peer: PeerPolicy

    def __call__(self, given: DecisionInputs, trace: DecisionTrace | None = None) -> Decision:
        """The peer's choice as a decision (our hot-prefix table, like cordons, is not its business)."""
        snapshot, view = given.snapshot, given.view
        if not snapshot.replicas:
            return Decision(replica=None, reason=Reason.NO_REPLICA)
        ordered = self.peer.choose(given.features, Fleet(snapshot.replicas, view.prefix_matches, given.now))
        return ranked_decision(given.features, view, given.profile, ordered)


def _rng(seed: int, rng: random.Random | None) -> random.Random:
    return rng if rng is not None else random.Random(seed)


def _by_name(candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    return sorted(candidates, key=lambda c: c.name)


def _first(chosen: ReplicaState, candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    """``chosen`` first, then the others by name (fallbacks)."""
    return [chosen, *(c for c in _by_name(candidates) if c is not chosen)]


class _Stateless:
    """A peer that learns nothing from where its requests went."""

    __slots__ = ()

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """Nothing to learn."""


# --- load-only peers -------------------------------------------------------------------------


@dataclass(slots=True)
class RoundRobin:
    """Each request to the next replica in name order."""

    name: str = "round_robin"
    _next: int = 0

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """The next replica in turn."""
        ordered = _by_name(fleet.replicas)
        i = self._next % len(ordered)
        return ordered[i:] + ordered[:i]

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """One request sent: the turn passes."""
        self._next += 1


@dataclass(slots=True)
class RandomChoice(_Stateless):
    """A replica drawn uniformly."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "random"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """A uniform draw."""
        assert self.rng is not None
        ordered = _by_name(fleet.replicas)
        return _first(ordered[self.rng.randrange(len(ordered))], ordered)


@dataclass(slots=True)
class LeastRequest(_Stateless):
    """The replica with the fewest requests in flight from this router; ties drawn at random."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "least_request"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """The least busy."""
        assert self.rng is not None
        ordered = _by_name(fleet.replicas)
        least = min(c.inflight for c in ordered)
        ties = [c for c in ordered if c.inflight == least]
        return _first(ties[self.rng.randrange(len(ties))], ordered)


@dataclass(slots=True)
class PowerOfTwo(_Stateless):
    """Two replicas drawn at random, the less loaded wins: load as the replicas last reported it
    (running + waiting, as vllm-router polls it), then the in-flight count."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "power_of_two"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """The lighter of two."""
        assert self.rng is not None
        ordered = _by_name(fleet.replicas)
        if len(ordered) == 1:
            return ordered
        a, b = self.rng.sample(ordered, 2)
        chosen = min((a, b), key=lambda c: (c.running + c.queue, c.inflight))
        return _first(chosen, ordered)


@dataclass(slots=True)
class ConsistentHash(_Stateless):
    """vllm-router's ``consistent_hash``: the session key (else the request id) on a ring of
    ``vnodes`` virtual nodes per replica; no load bound."""

    vnodes: int = 160
    name: str = "consistent_hash"
    _ring: HashRing | None = None
    _members: tuple[str, ...] = ()

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """The key's owner on the ring."""
        members = tuple(sorted(c.name for c in fleet.replicas))
        if self._ring is None or members != self._members:
            self._ring = HashRing(((m, 1.0) for m in members), self.vnodes)
            self._members = members
        f = request
        key = f.session_key or f.request_id or str(f.prefix_hashes[-1] if f.prefix_hashes else "")
        by_name = {c.name: c for c in fleet.replicas}
        return [by_name[n] for n in self._ring.preference(key) if n in by_name]


# --- SGLang ----------------------------------------------------------------------------------


class ApproximateTree:
    """What a router believes each replica holds, learned from its own decisions: for each
    replica, the prefix blocks it sent there, least recently sent evicted beyond a capacity."""

    def __init__(self, blocks_per_replica: int) -> None:
        self.blocks_per_replica = blocks_per_replica
        self._owners: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def size(self, replica: str) -> int:
        """Blocks believed held by ``replica``."""
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def matches(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` believed held, per replica."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        owners = self._owners
        for h in hashes:
            holders = owners.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for r in alive:
                out[r] += 1
        return out

    def insert(self, replica: str, hashes: Sequence[int]) -> None:
        """Remember that ``replica`` was sent ``hashes``."""
        lru = self._lru.setdefault(replica, OrderedDict())
        owners = self._owners
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                owners.setdefault(h, set()).add(replica)
        while len(lru) > self.blocks_per_replica:
            old, _ = lru.popitem(last=False)
            holders = owners.get(old)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del owners[old]


@dataclass(slots=True)
class SGLangCacheAware:
    """sglang-router's ``cache_aware`` policy with its default thresholds.

    Load is this router's in-flight count per replica. Its tree holds characters; here it holds
    64-character blocks (the request's prefix hashes), so a match is counted in whole blocks.
    ``max_tree_chars`` (2**26, its default) bounds each replica's share of the tree, which learns
    what was sent where when it is observed.
    """

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 26
    block_chars: int = 64
    name: str = "sglang_cache_aware"
    tree: ApproximateTree = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ApproximateTree(max(1, self.max_tree_chars // self.block_chars))

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """Shortest queue when imbalanced, else best match above the threshold, else smallest tree."""
        ordered = _by_name(fleet.replicas)
        f = request
        loads = [c.inflight for c in ordered]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen = min(ordered, key=lambda c: c.inflight)
        else:
            matched = self.tree.matches(f.prefix_hashes, [c.name for c in ordered])
            best = max(ordered, key=lambda c: (matched[c.name], -c.inflight))
            rate = matched[best.name] * self.block_chars / f.prompt_chars if f.prompt_chars else 0.0
            # Below the threshold: where the tree is smallest (the most room for new prefixes).
            chosen = best if rate > self.cache_threshold else min(ordered, key=lambda c: self.tree.size(c.name))
        return _first(chosen, ordered)

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """The prompt's blocks are now believed held by ``replica``."""
        self.tree.insert(replica, request.prefix_hashes)


# --- Dynamo ----------------------------------------------------------------------------------


@dataclass(slots=True)
class DynamoCost(_Stateless):
    """NVIDIA Dynamo's KV router cost: ``overlap_weight x prefill blocks + decode blocks``, lowest
    wins (temperature 0).

    Prefill blocks: the replica's prefill work still pending plus this prompt's uncached part;
    decode blocks: the blocks its running requests hold plus this prompt's. Dynamo tracks the
    active blocks of the requests it routed itself and learns the overlap from KV events: with a
    ``probe`` both come from the replicas' real state; without one, active blocks are the KV usage
    as last scraped times ``num_gpu_blocks`` and the overlap is the store's approximate index
    (Dynamo's ``--no-kv-events``).
    """

    overlap_weight: float = 1.0
    block_size: int = 16
    num_gpu_blocks: int = 27_545
    probe: CacheProbe | None = None
    router_block_chars: int = 64
    name: str = "dynamo_kv"

    def costs(self, request: RequestFeatures, fleet: Fleet) -> dict[str, float]:
        """Each replica's cost."""
        f = request
        prompt = f.estimated_prompt_tokens
        active: Mapping[str, int] | None = None
        if self.probe is not None:
            cached = dict(self.probe.cached_tokens(f))
            active = self.probe.active_blocks()
        else:
            per_block = self.router_block_chars // CHARS_PER_TOKEN
            cached = {n: m * per_block for n, m in fleet.prefix_matches.items()}
        bs = self.block_size
        request_blocks = math.ceil(prompt / bs)
        out = {}
        for c in fleet.replicas:
            overlap = min(prompt, cached.get(c.name, 0)) // bs * bs
            prefill_blocks = (c.pending_prefill_tokens + prompt - overlap) / bs
            held = active.get(c.name, 0) if active is not None else c.kv_usage * self.num_gpu_blocks
            decode_blocks = held + request_blocks
            out[c.name] = self.overlap_weight * prefill_blocks + decode_blocks
        return out

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """Lowest cost first."""
        costs = self.costs(request, fleet)
        return sorted(fleet.replicas, key=lambda c: (costs[c.name], c.name))


# --- scoring peers: GIE and llm-d ------------------------------------------------------------


@dataclass(slots=True)
class QueueScorer:
    """GIE's queue scorer: waiting requests as last scraped, min-max normalised (1 when all equal)."""

    name: str = "gie_queue"

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """(max - queue) / (max - min)."""
        queues = [c.queue for c in fleet.replicas]
        lo, hi = min(queues, default=0), max(queues, default=0)
        if hi == lo:
            return {c.name: 1.0 for c in fleet.replicas}
        return {c.name: (hi - c.queue) / (hi - lo) for c in fleet.replicas}


@dataclass(slots=True)
class KVCacheUtilizationScorer:
    """GIE's kv-cache utilization scorer: 1 - KV usage as last scraped."""

    name: str = "gie_kv_cache"

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """Free KV cache."""
        return {c.name: 1.0 - min(1.0, max(0.0, c.kv_usage)) for c in fleet.replicas}


@dataclass(slots=True)
class MatchFractionScorer:
    """GIE's prefix-cache scorer: matched blocks over the request's blocks, both capped at
    ``max_blocks`` (256), from an approximate index of its own decisions: each request's blocks
    recorded for the server it went to, an LRU of ``capacity_per_server`` blocks per server
    (GIE's ``lruCapacityPerServer``), nothing learned from the servers' metrics. Our router's
    estimate (capacities and trust from the replicas' scrapes, the prompts in flight) is ours, not
    GIE's."""

    max_blocks: int = 256
    capacity_per_server: int = 31_250
    index: PrefixIndex | None = None
    name: str = "gie_prefix"

    def __post_init__(self) -> None:
        if self.index is None:
            self.index = PrefixIndex(self.capacity_per_server)

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """Match fraction."""
        assert self.index is not None
        hashes = request.prefix_hashes[: self.max_blocks]
        if not hashes:
            return {}
        matches = self.index.matches(hashes)
        return {c.name: matches.get(c.name, 0) / len(hashes) for c in fleet.replicas}

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """Record the request's blocks for the server it went to (GIE's PreRequest)."""
        assert self.index is not None
        if request.prefix_hashes:
            self.index.add(replica, request.prefix_hashes[: self.max_blocks])


@dataclass(slots=True)
class PrecisePrefixScorer:
    """llm-d's precise prefix-cache scorer: each replica's longest cached prefix of the prompt, as
    its KV events report it (here: the probe of the replicas' real caches), in blocks, min-max
    normalised over the replicas that hold any (all of them 1 when they hold the same; 0 for a
    replica holding none), as llm-d normalises its indexed scores."""

    probe: CacheProbe
    block_size: int = 16
    name: str = "llmd_precise_prefix"

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """Matched blocks, min-max normalised over the holders."""
        cached = self.probe.cached_tokens(request)
        blocks = {c.name: n for c in fleet.replicas if (n := cached.get(c.name, 0) // self.block_size) > 0}
        if not blocks:
            return {}
        lo, hi = min(blocks.values()), max(blocks.values())
        return {name: 1.0 if hi == lo else (n - lo) / (hi - lo) for name, n in blocks.items()}


@dataclass(slots=True)
class LoadAwareScorer:
    """llm-d's load-aware scorer: 0.5 for a replica with no waiting requests, falling linearly to
    0 at ``threshold`` waiting (as last scraped)."""

    threshold: int = 128
    name: str = "llmd_load_aware"

    def score(self, request: RequestFeatures, fleet: Fleet) -> Mapping[str, float]:
        """Half a point for an empty queue, less as it fills."""
        cap = max(1, self.threshold)
        return {c.name: 0.5 * (1.0 - min(c.queue, cap) / cap) for c in fleet.replicas}


def _clamp(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


@dataclass(slots=True)
class MaxScorePolicy:
    """A scoring router (GIE's endpoint picker and llm-d's): each scorer's values clamped to
    [0, 1], weighted and summed; the highest total wins, equal totals in random order (GIE's
    max-score picker)."""

    name: str
    scorers: Sequence[tuple[PeerScorer, float]]
    seed: int = 0
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def totals(self, request: RequestFeatures, fleet: Fleet) -> dict[str, float]:
        """Each replica's weighted total."""
        totals = {c.name: 0.0 for c in fleet.replicas}
        for scorer, weight in self.scorers:
            for name, value in scorer.score(request, fleet).items():
                if name in totals:
                    totals[name] += weight * _clamp(value)
        return totals

    def observe(self, request: RequestFeatures, replica: str) -> None:
        """Scorers that keep an index of their own (GIE's prefix scorer) learn where it went."""
        for scorer, _ in self.scorers:
            learn = getattr(scorer, "observe", None)
            if learn is not None:
                learn(request, replica)

    def choose(self, request: RequestFeatures, fleet: Fleet) -> list[ReplicaState]:
        """Shuffle, then a stable sort by total."""
        assert self.rng is not None
        totals = self.totals(request, fleet)
        ordered = _by_name(fleet.replicas)
        self.rng.shuffle(ordered)
        return sorted(ordered, key=lambda c: -totals.get(c.name, 0.0))


def gie_default(seed: int = 0) -> MaxScorePolicy:
    """GIE's default profile: queue 2, kv-cache 2, prefix 3."""
    scorers: list[tuple[PeerScorer, float]] = [
        (QueueScorer(), 2.0),
        (KVCacheUtilizationScorer(), 2.0),
        (MatchFractionScorer(), 3.0),
    ]
    return MaxScorePolicy("gie_default", scorers, seed)


def llmd_precise(probe: CacheProbe, block_size: int = 16, seed: int = 0) -> MaxScorePolicy:
    """llm-d's precise prefix-cache profile: precise prefix 2, kv-cache utilization 1, queue 1."""
    scorers: list[tuple[PeerScorer, float]] = [
        (PrecisePrefixScorer(probe, block_size), 2.0),
        (KVCacheUtilizationScorer(), 1.0),
        (QueueScorer(), 1.0),
    ]
    return MaxScorePolicy("llmd_precise", scorers, seed)
