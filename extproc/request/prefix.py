"""Prefix block hashes: chained xxh3 over fixed-size blocks of the rendered prompt.

Block ``i``'s hash covers blocks ``0..i`` (each block is hashed with the previous hash as its
seed), so two prompts share hash ``i`` only if they share their first ``i + 1`` blocks. The
first seed is the model (and adapter) name: caches are not shared across models or adapters.
"""

from __future__ import annotations

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def model_seed(model: str) -> int:
    """The seed of a model's hash space (also covers a LoRA adapter, which is a model name)."""
    return _xxh3(model.encode("utf-8", "surrogatepass"))


def block_hashes(text: str, seed: int, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars``-sized blocks of ``text``, at most ``max_blocks``.

    A trailing partial block is not hashed: like vLLM's prefix cache, only full blocks are shared.
    """
    data = text.encode("utf-8", "surrogatepass")
    # Blocks are measured in characters of the text, approximated here by bytes: cheap, and
    # stable for a given text, which is all the index needs.
    end = min(len(data) // block_chars, max_blocks) * block_chars
    xxh3 = _xxh3  # the loop runs up to max_blocks times: keep it lean (a comprehension, no appends)
    h = seed
    return tuple([h := xxh3(data[start : start + block_chars], h) for start in range(0, end, block_chars)])
