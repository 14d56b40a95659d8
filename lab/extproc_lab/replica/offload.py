"""CPU memory behind the fake replica's KV cache, as vLLM's offloading connector keeps it.

vLLM 0.32's ``OffloadingConnector`` with its CPU backend copies each block the engine computes to
CPU memory (``num_cpu_blocks`` of them, least recently used evicted), and says so in its KV events
(``BlockStored``/``BlockRemoved`` with ``medium: "CPU"``, the same hashes, parent and tokens as
the GPU's events: ``offloading/events.py``, self-describing events). A request whose prefix the
GPU evicted but CPU memory still holds has those blocks loaded back rather than computed; they
count among its ``cached_tokens`` (the connector's hits are added to the local ones), not in
``vllm:prefix_cache_hits_total`` (the GPU pool's own), and once loaded the GPU pool caches them
again (a GPU ``BlockStored``).

The fake counts a loaded block as cached: loading it costs no step time here (on a GPU it is a
copy over PCIe, small against recomputing it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

CPU = "CPU"


class TierListener(Protocol):
    """Told of what CPU memory stores and evicts (the fake replica's KV events)."""

    def stored(self, key: int, medium: str = "GPU") -> None:
        """An entry was stored on ``medium``."""
        ...

    def evicted(self, key: int, medium: str = "GPU") -> None:
        """An entry left ``medium``."""
        ...


class CpuTier:
    """At most ``blocks`` KV blocks in CPU memory, least recently stored or loaded evicted first."""

    def __init__(self, blocks: int) -> None:
        if blocks < 1:
            raise ValueError("a CPU tier holds at least one block")
        self.capacity = blocks
        self.used = 0
        self._entries: OrderedDict[int, int] = OrderedDict()  # key -> its blocks, oldest first
        self.listener: TierListener | None = None

    def __len__(self) -> int:
        return self.used

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def store(self, key: int, blocks: int) -> None:
        """Copy an entry the GPU cached (again: it becomes the most recent)."""
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return
        if blocks > self.capacity:
            return
        entries[key] = blocks
        self.used += blocks
        if self.listener is not None:
            self.listener.stored(key, CPU)
        while self.used > self.capacity:
            old, size = entries.popitem(last=False)
            self.used -= size
            if self.listener is not None:
                self.listener.evicted(old, CPU)

    def run(self, keys: Sequence[int], start: int) -> int:
        """How many of ``keys`` from ``start`` on it holds, in a row."""
        n = 0
        for key in keys[start:]:
            if key not in self._entries:
                break
            n += 1
        return n

    def clear(self, announce: bool = False) -> None:
        """Drop everything; told block by block with ``announce`` (else the engine's
        ``AllBlocksCleared`` tells it for every tier)."""
        entries, self._entries = self._entries, OrderedDict()
        self.used = 0
        if announce and self.listener is not None:
            for key in entries:
                self.listener.evicted(key, CPU)
