"""Hot prefixes in the decision: a prefix found hot is served by k replicas, not one.

The detector (:mod:`extproc.observe.hotkeys`) says which prefix fingerprints are hot and how many replicas
each should have; the decision is given that table (fingerprint -> k) and stays pure. For a request
of a hot prefix that no session holds elsewhere, :class:`HotPrefixFilter` keeps its k replicas:
the first k on the ring from the prefix's own key that are under the bounded load (so gateways
that agree on the members and roughly on the load agree on the set without talking), and
:class:`HotPrefixScorer` prefers the least loaded of them, so every one of the k comes to hold
the prefix. A prefix that cools gets k = 1 for a while (its traffic gathers back on one
replica), then no entry: it is routed as any other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from extproc.routing.model import ReplicaState
from extproc.routing.plugins import CycleState
from extproc.routing.scorers import held_share, relative

_xxh3 = xxhash.xxh3_64_intdigest


def fingerprint(key: str | int) -> int:
    """A prefix ring key's 64-bit fingerprint: what the detector counts and the decision matches."""
    if isinstance(key, int):
        return _xxh3(key.to_bytes(8, "little", signed=key < 0))
    return _xxh3(key.encode("utf-8", "surrogatepass"))


def replica_set(
    cycle: CycleState, candidates: Sequence[ReplicaState], k: int, load_factor: float, min_bound: int = 8
) -> list[str]:
    """The hot prefix's k replicas among ``candidates``: ring order from its key, walking past
    replicas whose in-flight count is over ``load_factor`` times the mean (never a bound under
    ``min_bound``: at a handful of requests in flight a ratio says nothing), then filling from
    them in ring order if fewer than k are under it."""
    key = cycle.hot_key
    if key is None or not candidates:
        return []
    names = {c.name: c for c in candidates}
    order = [n for n in cycle.ring.preference(key) if n in names]
    bound = max(min_bound, math.ceil(load_factor * (sum(c.inflight for c in candidates) + 1) / len(candidates)))
    chosen = [n for n in order if names[n].inflight + 1 <= bound][:k]
    if len(chosen) < k:
        chosen += [n for n in order if n not in chosen][: k - len(chosen)]
    return chosen


@dataclass(slots=True)
class HotPrefixFilter:
    """Keeps a hot prefix's k replicas for a request no live session pin holds elsewhere (k = 1:
    a prefix that cooled, gathered back on one replica)."""

    load_factor: float = 1.25
    min_bound: int = 8
    name: str = "hot_prefix"

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """Drop replicas outside the hot prefix's set."""
        k = cycle.hot_replicas
        if k < 1:
            return candidates
        pinned = cycle.view.pinned
        if pinned and any(c.name == pinned for c in candidates):
            return candidates  # a conversation stays where its own cache is
        chosen = frozenset(replica_set(cycle, candidates, k, self.load_factor, self.min_bound))
        cycle.hot_set = chosen
        kept = [c for c in candidates if c.name in chosen]
        return kept or candidates

    def why(self, state: ReplicaState) -> str:
        """Why a replica was dropped (the trace)."""
        return "not among the hot prefix's replicas"


@dataclass(slots=True)
class HotPrefixScorer:
    """Within a hot prefix's set, lighter is better, so each of the k takes its share and comes to
    hold the prefix; scores nothing for other requests.

    Lighter means the least outstanding work (prefill tokens not yet answered plus a decode cost
    per request in flight). With ``count_uncached`` it also counts what this request would add
    there, the part of its prompt the replica is not believed to hold: a member new to the set is
    then used only once the holders' queues cost more than its cold prefill (fewer requests queue
    behind that prefill, but at light load the set never spreads). Off by default: the set is
    spread by load, as the hot-key design asks, so that every one of the k comes to hold it.
    """

    tokens_per_request: int = 256
    floor_tokens: int = 1024
    count_uncached: bool = False
    name: str = "hot_prefix"

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """1 for the least loaded of the set, falling with extra work."""
        chosen = cycle.hot_set
        if not chosen:
            return {}
        f = cycle.features
        total = len(f.prefix_hashes)
        matches = cycle.view.prefix_matches
        work = {}
        for c in candidates:
            if c.name in chosen:
                work[c.name] = float(c.work(self.tokens_per_request))
                if self.count_uncached and total:
                    work[c.name] += f.estimated_prompt_tokens * (1.0 - held_share(matches, c.name, total))
        return relative(work, float(self.floor_tokens)) if work else {}
