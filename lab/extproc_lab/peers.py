"""Other routers' policies as plugins of our pipeline, so a benchmark compares them fairly: same
request features, same replica snapshots, same store, only the choice differs.

Each is written from its project's published behaviour (the projects' documentation and
published benchmarks), not from their code:

- ``round_robin``, ``random``, ``least_request``, ``power_of_two`` (vllm-router, sglang-router,
  Envoy): pickers over the candidates. Randomness comes from a generator seeded by the profile
  (``seed``) or passed in (``rng``), never from the clock.
- ``consistent_hash`` (vllm-router, vLLM production-stack): a ring of 160 virtual nodes per
  replica on the session key (else the request id, as vllm-router falls back to a hash of the
  request), with no load bound.
- ``sglang_cache_aware`` (sglang-router): an approximate tree of what it sent where; if the
  in-flight spread is over ``balance_abs_threshold`` and ``balance_rel_threshold`` times the
  least, the least loaded; else the best match if its match rate is over ``cache_threshold``,
  else the replica with the smallest tree.
- ``gie_queue`` / ``gie_kv_cache`` / ``gie_prefix`` scorers and ``gie_max_score`` picker (Gateway
  API Inference Extension's default profile: queue 2, kv-cache 2, prefix 3; ties broken at random).
- ``dynamo_kv`` (NVIDIA Dynamo's KV router): lowest ``overlap_weight x prefill blocks + decode
  blocks``, the overlap taken from the replicas' real caches (KV events) when a probe is given.
- ``llmd_precise`` (llm-d's precise prefix-cache routing): ``llmd_precise_prefix`` (the longest
  prefix each replica really holds, from KV events, over the best candidate's), ``llmd_load_aware``
  (waiting requests, 0.5 when none, falling to 0 at a threshold of 128) and GIE's kv-cache
  utilization scorer; the benchmark's ``llmd_precise`` weighs precise prefix 2, kv-cache
  utilization 1 and queue 1, as llm-d's precise-prefix-cache guide configures them.
- ``oracle``: the longest prefix the replicas *really* hold, greedy (no longer in the benchmark:
  it herded everything onto one replica; ``dynamo_kv`` and ``llmd_precise`` read the true cache
  and load instead).

Pickers of other routers keep the state those routers keep (a round-robin counter, an
approximate tree) and update it when they pick: they stand for a whole router, not for one
stage of ours.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.request.features import CHARS_PER_TOKEN, RequestFeatures
from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState, Picker, Scorer
from extproc.routing.registry import REGISTRY
from extproc.routing.ring import HashRing


class CacheProbe(Protocol):
    """What the replicas really hold: a simulator's view of their caches, or what a router fed by
    KV events and tracking its own requests knows."""

    def cached_tokens(self, features: RequestFeatures) -> Mapping[str, int]:
        """Cached prompt tokens per replica name (replicas holding none may be omitted)."""
        ...

    def active_blocks(self) -> Mapping[str, int]:
        """KV blocks held by each replica's running requests."""
        ...


def _rng(seed: int, rng: random.Random | None) -> random.Random:
    return rng if rng is not None else random.Random(seed)


def _by_name(candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    return sorted(candidates, key=lambda c: c.name)


def _first(chosen: ReplicaState, candidates: Sequence[ReplicaState]) -> list[ReplicaState]:
    """``chosen`` first, then the others by name (fallbacks)."""
    return [chosen, *(c for c in _by_name(candidates) if c is not chosen)]


# --- load-only pickers ---------------------------------------------------------------------


@dataclass(slots=True)
class RoundRobinPicker:
    """Each request to the next replica in name order."""

    name: str = "round_robin"
    _next: int = 0

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """The next replica in turn."""
        ordered = _by_name(candidates)
        i = self._next % len(ordered)
        self._next += 1
        return ordered[i:] + ordered[:i]


@dataclass(slots=True)
class RandomPicker:
    """A replica drawn uniformly."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "random"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """A uniform draw."""
        assert self.rng is not None
        ordered = _by_name(candidates)
        return _first(ordered[self.rng.randrange(len(ordered))], ordered)


@dataclass(slots=True)
class LeastRequestPicker:
    """The replica with the fewest requests in flight from this router; ties drawn at random."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "least_request"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """The least busy."""
        assert self.rng is not None
        ordered = _by_name(candidates)
        least = min(c.inflight for c in ordered)
        ties = [c for c in ordered if c.inflight == least]
        return _first(ties[self.rng.randrange(len(ties))], ordered)


@dataclass(slots=True)
class PowerOfTwoPicker:
    """Two replicas drawn at random, the less loaded wins: load as the replicas last reported it
    (running + waiting, as vllm-router polls it), then the in-flight count."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "power_of_two"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """The lighter of two."""
        assert self.rng is not None
        ordered = _by_name(candidates)
        if len(ordered) == 1:
            return ordered
        a, b = self.rng.sample(ordered, 2)
        chosen = min((a, b), key=lambda c: (c.running + c.queue, c.inflight))
        return _first(chosen, ordered)


@dataclass(slots=True)
class ConsistentHashPicker:
    """vllm-router's ``consistent_hash``: the session key (else the request id) on a ring of
    ``vnodes`` virtual nodes per replica; no load bound."""

    vnodes: int = 160
    name: str = "consistent_hash"
    _ring: HashRing | None = None
    _members: tuple[str, ...] = ()

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """The key's owner on the ring."""
        members = tuple(sorted(c.name for c in candidates))
        if self._ring is None or members != self._members:
            self._ring = HashRing(((m, 1.0) for m in members), self.vnodes)
            self._members = members
        f = cycle.features
        key = f.session_key or f.request_id or str(f.prefix_hashes[-1] if f.prefix_hashes else "")
        by_name = {c.name: c for c in candidates}
        order = self._ring.preference(key)
        return [by_name[n] for n in order if n in by_name]


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
class SGLangCacheAwarePicker:
    """sglang-router's ``cache_aware`` policy with its default thresholds.

    Load is this router's in-flight count per replica. Its tree holds characters; here it holds
    64-character blocks (the request's prefix hashes), so a match is counted in whole blocks.
    ``max_tree_chars`` (2**26, its default) bounds each replica's share of the tree.
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

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Shortest queue when imbalanced, else best match above the threshold, else smallest tree."""
        ordered = _by_name(candidates)
        f = cycle.features
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
        self.tree.insert(chosen.name, f.prefix_hashes)
        return _first(chosen, ordered)


# --- GIE -------------------------------------------------------------------------------------


@dataclass(slots=True)
class QueueScorer:
    """GIE's queue scorer: waiting requests as last scraped, min-max normalised (1 when all equal)."""

    name: str = "gie_queue"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """(max - queue) / (max - min)."""
        queues = [c.queue for c in candidates]
        lo, hi = min(queues, default=0), max(queues, default=0)
        if hi == lo:
            return {c.name: 1.0 for c in candidates}
        return {c.name: (hi - c.queue) / (hi - lo) for c in candidates}


@dataclass(slots=True)
class KVCacheUtilizationScorer:
    """GIE's kv-cache utilization scorer: 1 - KV usage as last scraped."""

    name: str = "gie_kv_cache"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Free KV cache."""
        return {c.name: 1.0 - min(1.0, max(0.0, c.kv_usage)) for c in candidates}


@dataclass(slots=True)
class MatchFractionScorer:
    """GIE's prefix-cache scorer: matched blocks over the request's blocks, both capped at
    ``max_blocks`` (256), from the approximate index of its own decisions (the store's)."""

    max_blocks: int = 256
    name: str = "gie_prefix"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Match fraction."""
        total = min(len(cycle.features.prefix_hashes), self.max_blocks)
        if not total:
            return {}
        matches = cycle.view.prefix_matches
        return {c.name: min(matches.get(c.name, 0), self.max_blocks) / total for c in candidates}


@dataclass(slots=True)
class RandomTieMaxScorePicker:
    """GIE's max-score picker: highest total first, equal totals in random order."""

    seed: int = 0
    rng: random.Random | None = None
    name: str = "gie_max_score"

    def __post_init__(self) -> None:
        self.rng = _rng(self.seed, self.rng)

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Shuffle, then a stable sort by score."""
        assert self.rng is not None
        ordered = _by_name(candidates)
        self.rng.shuffle(ordered)
        return sorted(ordered, key=lambda c: -totals.get(c.name, 0.0))


# --- Dynamo and the oracle -------------------------------------------------------------------


@dataclass(slots=True)
class DynamoCostPicker:
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

    def costs(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> dict[str, float]:
        """Each candidate's cost."""
        f = cycle.features
        prompt = f.estimated_prompt_tokens
        active: Mapping[str, int] | None = None
        if self.probe is not None:
            cached = dict(self.probe.cached_tokens(f))
            active = self.probe.active_blocks()
        else:
            per_block = self.router_block_chars // CHARS_PER_TOKEN
            cached = {n: m * per_block for n, m in cycle.view.prefix_matches.items()}
        bs = self.block_size
        request_blocks = math.ceil(prompt / bs)
        out = {}
        for c in candidates:
            overlap = min(prompt, cached.get(c.name, 0)) // bs * bs
            prefill_blocks = (c.pending_prefill_tokens + prompt - overlap) / bs
            held = active.get(c.name, 0) if active is not None else c.kv_usage * self.num_gpu_blocks
            decode_blocks = held + request_blocks
            out[c.name] = self.overlap_weight * prefill_blocks + decode_blocks
        return out

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Lowest cost first."""
        costs = self.costs(cycle, candidates)
        return sorted(candidates, key=lambda c: (costs[c.name], c.name))


@dataclass(slots=True)
class OraclePicker:
    """The replica that really holds the longest prefix of the prompt; ties to the fewest in
    flight. Greedy on the cache alone, so not an upper bound: it can strand replicas that never
    get a hit."""

    probe: CacheProbe
    name: str = "oracle"

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Longest true match first."""
        cached = self.probe.cached_tokens(cycle.features)
        return sorted(candidates, key=lambda c: (-cached.get(c.name, 0), c.inflight, c.name))


# --- llm-d ------------------------------------------------------------------------------------


@dataclass(slots=True)
class PrecisePrefixScorer:
    """llm-d's precise prefix-cache scorer: each replica's longest cached prefix of the prompt, as
    its KV events report it (here: the probe of the replicas' real caches), in blocks, min-max
    normalised over the replicas that hold any (all of them 1 when they hold the same; 0 for a
    replica holding none), as llm-d normalises its indexed scores."""

    probe: CacheProbe | None = None
    block_size: int = 16
    name: str = "llmd_precise_prefix"

    def __post_init__(self) -> None:
        if self.probe is None:
            raise ValueError("llmd_precise_prefix needs the replicas' cache state (a probe)")

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Matched blocks, min-max normalised over the holders."""
        assert self.probe is not None
        cached = self.probe.cached_tokens(cycle.features)
        blocks = {c.name: n for c in candidates if (n := cached.get(c.name, 0) // self.block_size) > 0}
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

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """Half a point for an empty queue, less as it fills."""
        cap = max(1, self.threshold)
        return {c.name: 0.5 * (1.0 - min(c.queue, cap) / cap) for c in candidates}


PEER_SCORERS: dict[str, Callable[..., Scorer]] = {
    "llmd_precise_prefix": PrecisePrefixScorer,
    "llmd_load_aware": LoadAwareScorer,
    "gie_queue": QueueScorer,
    "gie_kv_cache": KVCacheUtilizationScorer,
    "gie_prefix": MatchFractionScorer,
}
PEER_PICKERS: dict[str, Callable[..., Picker]] = {
    "round_robin": RoundRobinPicker,
    "random": RandomPicker,
    "least_request": LeastRequestPicker,
    "power_of_two": PowerOfTwoPicker,
    "consistent_hash": ConsistentHashPicker,
    "sglang_cache_aware": SGLangCacheAwarePicker,
    "gie_max_score": RandomTieMaxScorePicker,
    "dynamo_kv": DynamoCostPicker,
    "oracle": OraclePicker,
}

PEER_REGISTRY = REGISTRY.extended(scorers=PEER_SCORERS, pickers=PEER_PICKERS)
"""The router's plugins and the peers' policies: what the lab's profiles may name."""
