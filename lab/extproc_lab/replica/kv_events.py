"""The fake replica's prefix cache in vLLM's terms: token blocks keyed by vLLM's block hashes,
and every store, eviction and reset turned into the events vLLM publishes.

:class:`TokenBlocks` turns a prompt's token ids into the pool's keys (the engine chain's int
forms, one per full block) and remembers each key's parent and tokens while it may be cached.
:class:`KvEventRecorder` is the pool's listener: it collects the events of one engine step, merged
as vLLM merges them (consecutive blocks of one chain in one ``BlockStored``), for the engine to
publish when the step ends.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from extproc.api import AllBlocksCleared, BlockRemoved, BlockStored, Event
from extproc.api.sim import EngineChain, HashAlgo, low64

GPU = "GPU"


class TokenBlocks:
    """Keys of token blocks, hashed as the engine hashes them (``PYTHONHASHSEED`` honoured)."""

    def __init__(self, block_size: int, algo: HashAlgo = HashAlgo.SHA256, seed: str | None = None) -> None:
        self.block_size = block_size
        self.chain = EngineChain(algo, seed if seed is not None else os.environ.get("PYTHONHASHSEED"))
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}
        """key -> (parent key, token ids, LoRA name), for keys that may be cached (dropped on eviction)."""

    def keys(
        self, token_ids: Sequence[int], max_blocks: int, lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """The prompt's block keys; remembers what a ``BlockStored`` of each must carry.

        Extra keys as vLLM's: under a LoRA adapter every block's are ``(lora_name,)``; a request's
        ``cache_salt`` follows it in the first block's."""
        bs = self.block_size
        extra = (lora_name,) if lora_name else None
        if cache_salt and max_blocks >= 1 and len(token_ids) >= bs:
            head = self.chain.digests(token_ids[:bs], bs, (*(extra or ()), cache_salt))
            digests = head + self.chain.digests(token_ids[bs:], bs, extra, max_blocks - 1, parent=head[0])
        else:
            digests = self.chain.digests(token_ids, bs, extra, max_blocks)
        out = []
        parent: int | None = None
        for i, d in enumerate(digests):
            key = low64(d)
            if key not in self.blocks:
                self.blocks[key] = (parent, tuple(token_ids[i * bs : (i + 1) * bs]), lora_name)
            out.append(key)
            parent = key
        return tuple(out)


class KvEventRecorder:
    """A :class:`~extproc_lab.replica.model.KVPool` listener collecting one step's events, and the
    listener of the CPU memory behind it (:mod:`extproc_lab.replica.offload`), whose events carry
    ``medium: "CPU"`` and go out after the GPU's of the same step."""

    def __init__(self, blocks: TokenBlocks | None = None) -> None:
        self.blocks = blocks
        self.pending: list[Event] = []
        self.pending_offload: list[Event] = []
        self.holds: Callable[[int], bool] = lambda key: False
        """Whether a tier still holds ``key`` (then its parent and tokens are kept for its events)."""

    def stored(self, key: int, medium: str = GPU) -> None:
        """A block entered the cache (``medium``: the GPU's, or CPU memory)."""
        if self.blocks is None:
            return
        pending = self.pending if medium == GPU else self.pending_offload
        parent, tokens, lora = self.blocks.blocks.get(key, (None, (), None))
        last = pending[-1] if pending else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            pending[-1] = BlockStored(
                (*last.block_hashes, key), last.parent, [*last.token_ids, *tokens], last.block_size, medium, lora
            )
        else:
            pending.append(BlockStored((key,), parent, list(tokens), self.blocks.block_size, medium, lora))

    def evicted(self, key: int, medium: str = GPU) -> None:
        """A block left the cache (``medium``: the GPU's, or CPU memory)."""
        if self.blocks is not None and not self.holds(key):
            self.blocks.blocks.pop(key, None)
        pending = self.pending if medium == GPU else self.pending_offload
        last = pending[-1] if pending else None
        if isinstance(last, BlockRemoved):
            pending[-1] = BlockRemoved((*last.block_hashes, key), medium)
        else:
            pending.append(BlockRemoved((key,), medium))

    def cleared(self) -> None:
        """The whole cache was reset."""
        self.pending.append(AllBlocksCleared())

    def drain(self) -> list[Event]:
        """The events collected since the last drain: the GPU's, then CPU memory's."""
        out = self.pending + self.pending_offload
        self.pending, self.pending_offload = [], []
        return out
