"""The prompts of the requests this router has in flight, per replica: prefixes a replica will hold.

The prefix index forgets in the replica's LRU order within its capacity, as it should for what
the replica has finished. What a replica is running or has queued is different: a running
request's blocks cannot be evicted, and a queued one is prefilled before anything sent after it.
A request sent behind one that shares its prefix finds that prefix cached when its turn comes,
however long the queue. Under pressure the queue can be longer than the cache (shared-prefix at
6,000 blocks: 51 queued on a replica whose cache holds 12 prompts), and the index alone had
already forgotten a group whose requests were still waiting there; the next request of the group
went elsewhere and prefilled its 6,000-token system prompt cold.

This table is the router's own knowledge (like its in-flight counts), never shared between
gateways: it is added to at the decision and taken from when the request ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class InflightPrefixes:
    """Per replica, how many in-flight requests cover each prefix block hash."""

    def __init__(self) -> None:
        self._per_replica: dict[str, dict[int, int]] = {}

    def add(self, replica: str, hashes: Sequence[int]) -> None:
        """A request whose prompt has ``hashes`` was sent to ``replica``."""
        if not hashes:
            return
        counts = self._per_replica.get(replica)
        if not counts or counts.keys().isdisjoint(hashes):
            # Nothing of it in flight there (the usual case): counted at once, in C. A prompt
            # whose hashes repeat (a collision) is counted one by one below, as its repeats count.
            fresh = dict.fromkeys(hashes, 1)
            if len(fresh) == len(hashes):
                if counts:
                    counts.update(fresh)
                else:
                    self._per_replica[replica] = fresh
                return
        if counts is None:
            counts = self._per_replica[replica] = {}
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1

    def remove(self, replica: str, hashes: Sequence[int]) -> None:
        """That request ended (or was abandoned)."""
        counts = self._per_replica.get(replica)
        if counts is None:
            return
        if len(counts) == len(hashes) and sum(counts.values()) == len(counts) and all(map(counts.__contains__, hashes)):
            # It was the only request in flight there (each of its blocks counted once, and
            # nothing else): every count goes to zero, so the table goes at once.
            del self._per_replica[replica]
            return
        for h in hashes:
            n = counts.get(h, 0)
            if n > 1:
                counts[h] = n - 1
            elif n:
                del counts[h]
        if not counts:
            del self._per_replica[replica]

    def forget(self, replicas: Iterable[str]) -> None:
        """Replicas that left the fleet."""
        for name in replicas:
            self._per_replica.pop(name, None)

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica with a request in flight sharing the first block, how many leading
        blocks of ``hashes`` those requests cover (hashes are chained: covering block ``i`` means
        covering ``0..i``, so a binary search finds the longest)."""
        if not hashes or not self._per_replica:
            return {}
        first, last = hashes[0], len(hashes) - 1
        out: dict[str, int] = {}
        for replica, counts in self._per_replica.items():
            if first not in counts:
                continue
            lo, hi = 0, last
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid] in counts:
                    lo = mid
                else:
                    hi = mid - 1
            out[replica] = lo + 1
        return out

    def __len__(self) -> int:
        """Replicas with requests in flight that carry prefix hashes."""
        return len(self._per_replica)


def longer(matches: Mapping[str, int], inflight: Mapping[str, int]) -> Mapping[str, int]:
    """``matches`` with each replica's in-flight cover where that is longer (``matches`` itself
    when it adds nothing)."""
    if not inflight or all(matches.get(r, 0) >= n for r, n in inflight.items()):
        return matches
    out = dict(matches)
    for replica, n in inflight.items():
        if n > out.get(replica, 0):
            out[replica] = n
    return out
