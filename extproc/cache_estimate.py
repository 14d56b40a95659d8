"""What the router believes each replica's prefix cache holds, kept honest by the replica itself.

Without KV events the prefix index is a guess from the router's own decisions. Two things the
replicas report keep it close to what they really hold:

- **capacity**: ``vllm:cache_config_info`` gives ``num_gpu_blocks`` and ``block_size``; the index
  keeps at most that many tokens per replica (times ``capacity_share``: running requests hold
  blocks for their output too), least recently routed evicted first, as the replica evicts;
- **trust**: ``vllm:prefix_cache_hits_total / queries_total`` say how many prompt tokens the
  replica really found cached. Over the same period the index claimed some number of tokens
  for the requests it sent there; a replica that hits less than the index claimed is trusted
  less, and its claims are scaled down by the ratio (smoothed over scrapes). A replica whose
  counters agree keeps full trust.

The estimate is fed by the router: each decision's claim (:meth:`claimed`), and each scrape's
counters (:meth:`observe`); it never reads a clock or performs I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.health.replicas import ReplicaBook
from extproc.routing.model import AffinityView
from extproc.state.store import AffinityStore


@dataclass(slots=True)
class _Trust:
    """Per replica: claimed and reported hit tokens since the last scrape, smoothed ratios."""

    claimed: float = 0.0
    """Tokens the index claimed cached for requests sent since the last scrape."""
    hits: float | None = None
    """The replica's hit counter at the last scrape."""
    smoothed_claimed: float = 0.0
    smoothed_hits: float = 0.0
    trust: float = 1.0
    capacity_tokens: int | None = None


class CacheEstimate:
    """Capacities and trust per replica; see the module docstring.

    ``block_tokens`` is the size of one prefix-index block in tokens (the router's block
    characters over characters per token). ``min_claimed_tokens`` is how many claimed tokens the
    smoothed window needs before trust moves (a handful of requests says little). ``decay`` is the
    weight older scrapes keep in the smoothed sums.
    """

    def __init__(
        self,
        block_tokens: int = 16,
        capacity_share: float = 0.9,
        min_claimed_tokens: float = 20_000.0,
        decay: float = 0.8,
        min_trust: float = 0.05,
    ) -> None:
        self.block_tokens = max(1, block_tokens)
        self.capacity_share = capacity_share
        self.min_claimed_tokens = min_claimed_tokens
        self.decay = decay
        self.min_trust = min_trust
        self._replicas: dict[str, _Trust] = {}
        self._scrapes_seen = -1
        self._scraped_at: dict[str, float] = {}

    def _get(self, replica: str) -> _Trust:
        t = self._replicas.get(replica)
        if t is None:
            t = self._replicas[replica] = _Trust()
        return t

    def trust(self, replica: str) -> float:
        """How far the index's claims for ``replica`` are believed, in [min_trust, 1]."""
        t = self._replicas.get(replica)
        return t.trust if t is not None else 1.0

    def capacity_blocks(self, num_gpu_blocks: int, block_size: int) -> int:
        """Index blocks a replica of ``num_gpu_blocks`` blocks of ``block_size`` tokens can hold."""
        return max(1, int(num_gpu_blocks * block_size * self.capacity_share) // self.block_tokens)

    def observe(
        self,
        replica: str,
        prefix_hits: float | None,
        *,
        num_gpu_blocks: int | None = None,
        block_size: int | None = None,
    ) -> int | None:
        """Take in one scrape of ``replica``: its hit counter (cumulative tokens) and cache size.
        Returns the index capacity in blocks when it is new or changed (the caller hands it to
        the store), else None."""
        t = self._get(replica)
        changed = None
        if num_gpu_blocks and block_size:
            cap = self.capacity_blocks(num_gpu_blocks, block_size)
            if cap != t.capacity_tokens:
                t.capacity_tokens = cap
                changed = cap
        if prefix_hits is None:  # the page reports no prefix-cache counters: nothing to judge trust by
            return changed
        if t.hits is None or prefix_hits < t.hits:
            # The first scrape, or the replica restarted (counters reset): a new baseline.
            t.hits = prefix_hits
            t.claimed = 0.0
            return changed
        hits, t.hits = prefix_hits - t.hits, prefix_hits
        t.smoothed_claimed = self.decay * t.smoothed_claimed + t.claimed
        t.smoothed_hits = self.decay * t.smoothed_hits + hits
        t.claimed = 0.0
        if t.smoothed_claimed >= self.min_claimed_tokens:
            ratio = t.smoothed_hits / t.smoothed_claimed
            t.trust = min(1.0, max(self.min_trust, ratio))
        return changed

    def claimed(self, replica: str, tokens: int) -> None:
        """A request went to ``replica`` with ``tokens`` of its prompt claimed cached there (the
        index's raw claim, before trust)."""
        if tokens > 0:
            self._get(replica).claimed += tokens

    def adjust(self, view: AffinityView) -> AffinityView:
        """The view with each replica's prefix match scaled by its trust (a match scaled to no
        block is dropped)."""
        matches = view.prefix_matches
        if not matches or not self._replicas:
            return view
        scaled: dict[str, int] = {}
        changed = False
        for name, n in matches.items():
            t = self._replicas.get(name)
            trust = t.trust if t is not None else 1.0
            if trust >= 1.0:
                scaled[name] = n
                continue
            changed = True
            m = int(n * trust)
            if m > 0:
                scaled[name] = m
        return AffinityView(view.pinned, scaled) if changed else view

    def trusts(self) -> Mapping[str, float]:
        """Trust per replica seen so far (for metrics and reports)."""
        return {name: t.trust for name, t in self._replicas.items()}

    def sync(self, book: ReplicaBook, store: AffinityStore) -> None:
        """Take in the scrapes ``book`` received since the last call; hand changed capacities to
        ``store``. Cheap when nothing new arrived (one comparison)."""
        if book.scrapes == self._scrapes_seen:
            return
        self._scrapes_seen = book.scrapes
        for rec in book.records():
            m = rec.metrics
            name = rec.replica.name
            if m is None or self._scraped_at.get(name) == rec.scraped_at:
                continue
            self._scraped_at[name] = rec.scraped_at
            capacity = self.observe(name, m.prefix_hits, num_gpu_blocks=m.num_gpu_blocks, block_size=m.block_size)
            if capacity is not None:
                store.set_capacity(name, capacity)
