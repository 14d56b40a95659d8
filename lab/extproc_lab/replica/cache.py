"""A bare prefix cache: KV blocks keyed by chained prefix hashes, evicted least recently used.

The replica model keeps its blocks in :class:`~extproc_lab.replica.model.KVPool` (shared entries with
reference counts, alongside the blocks of running requests). This simpler cache, with no requests
holding blocks, is what the benchmark's ceilings are computed with: ``pooled`` (one cache with the
whole fleet's capacity receiving every request) and ``ideal`` (one cache without bound).

Blocks are hashed exactly as the router hashes them (:func:`extproc.api.sim.block_hashes`
seeded with the model), so what the router believes a replica holds and what the replica really
holds can be compared block for block.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from extproc.api import CHARS_PER_TOKEN
from extproc.api.sim import block_hashes, model_seed

"""Tokens are approximated as four characters (UTF-8 bytes) of the rendered prompt."""


def count_tokens(text: str) -> int:
    """Approximate token count of ``text`` (at least 1: a real prompt always has a token)."""
    # Bytes rather than characters, to agree with how block_hashes cuts blocks.
    return max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / CHARS_PER_TOKEN))


class PrefixCache:
    """At most ``num_gpu_blocks`` KV blocks of ``block_size`` tokens, least recently used evicted first.

    Counters are in tokens, like vLLM's ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``,
    and only ever grow; :meth:`reset` drops the blocks, not the counters.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int = 16) -> None:
        if num_gpu_blocks < 1 or block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be at least 1")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.queries_tokens = 0
        self.hits_tokens = 0
        # Oldest first: popitem(last=False) is the eviction.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def block_chars(self) -> int:
        """Characters (bytes) of prompt text per block."""
        return self.block_size * CHARS_PER_TOKEN

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def hashes_for(self, text: str, model: str) -> tuple[int, ...]:
        """The chained hashes of the full blocks of ``text`` for ``model``."""
        # Blocks past the capacity could never be held together with the ones before them.
        return block_hashes(text, model_seed(model), self.block_chars, self.num_gpu_blocks)

    def match_and_store(self, hashes: Sequence[int], prompt_tokens: int | None = None) -> int:
        """Count the leading blocks of ``hashes`` already cached, then store or refresh them all.

        Returns the number of cached leading blocks (the match stops at the first miss, since a
        block is only reusable with everything before it). ``prompt_tokens`` is what the query
        counter adds (default: the tokens of the full blocks).
        """
        hashes = hashes[: self.num_gpu_blocks]
        cached = 0
        for h in hashes:
            if h not in self._blocks:
                break
            cached += 1
        queried = len(hashes) * self.block_size if prompt_tokens is None else prompt_tokens
        self.queries_tokens += queried
        self.hits_tokens += min(cached * self.block_size, queried)
        # Refreshed last block first, so the first block is the most recently used: as in vLLM,
        # the tail of a prompt is evicted before its head, which keeps shared prefixes longest.
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
        while len(self._blocks) > self.num_gpu_blocks:
            self._blocks.popitem(last=False)
        return cached

    def reset(self) -> None:
        """Drop every block (vLLM's ``/reset_prefix_cache``); the counters keep their totals."""
        self._blocks.clear()


class WeightedPrefixCache:
    """:class:`PrefixCache` for keys that each cover several blocks (a trace's 512-token groups):
    capacity and counters in blocks, least recently used keys evicted first; ``None`` capacity
    never evicts (the ``ideal`` ceiling)."""

    def __init__(self, num_blocks: int | None) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError("num_blocks must be at least 1 (or None for no bound)")
        self.num_blocks = num_blocks
        self.blocks = 0
        self._entries: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return self.blocks

    def match_and_store(self, keys: Sequence[int], sizes: Sequence[int]) -> int:
        """Blocks of the longest cached prefix of ``keys`` (key ``i`` covers ``sizes[i]`` blocks);
        then every key is stored or refreshed, the head last so it is evicted last."""
        entries = self._entries
        hit = 0
        for key, size in zip(keys, sizes, strict=False):
            if key not in entries:
                break
            hit += size
        for key, size in zip(reversed(keys), reversed(sizes), strict=False):
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = size
                self.blocks += size
        if self.num_blocks is not None:
            while self.blocks > self.num_blocks and entries:
                _, size = entries.popitem(last=False)
                self.blocks -= size
        return hit
