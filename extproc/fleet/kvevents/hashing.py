"""Block hashes as vLLM computes them, and our own content hashes.

vLLM hashes each full block of ``block_size`` tokens as ``hash_fn((parent, tuple(tokens), extra_keys))``,
``parent`` being the previous block's full digest and, for the first block, ``NONE_HASH``. With the
``sha256`` and ``sha256_cbor`` algorithms ``NONE_HASH`` is ``hash_fn(seed)``, the seed being the
engine's ``PYTHONHASHSEED`` if set, else a fixed string: the router can then compute the engine's
chain from the prompt's token ids. The events carry a hash as the digest's low 64 bits (the default)
or as the raw digest; :func:`event_hash` brings both to the same int.

Where the engine's hash cannot be reproduced (``xxhash`` algorithms, or a random seed), the index is
keyed by :func:`content_chain` instead: chained xxh3-64 over the token ids a ``BlockStored`` carries,
which the router computes the same way from the prompt.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

DEFAULT_SEED = "vllm-none-hash"
"""What vLLM 0.33 hashes into ``NONE_HASH`` for sha256 and sha256_cbor when PYTHONHASHSEED is unset."""

LOW64 = (1 << 64) - 1
CONTENT_SEED = 1337
"""The seed of :func:`content_chain` (Dynamo's and SGLang's gateway choice for their XXH3-64)."""


class HashAlgo(enum.StrEnum):
    """How the index keys blocks: the engine's own chain, or content hashes of the token ids."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    CONTENT = "content"


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algo: HashAlgo) -> Callable[[Any], bytes]:
    """vLLM's ``hash_fn`` for ``algo`` (``content`` has none: it is not the engine's hash)."""
    if algo is HashAlgo.SHA256:
        return _sha256_pickle
    if algo is HashAlgo.SHA256_CBOR:
        return _sha256_cbor
    raise ValueError(f"{algo} is not an engine hash algorithm")


def none_hash(algo: HashAlgo, seed: str | None = None) -> bytes:
    """The parent digest of a chain's first block: ``hash_fn(PYTHONHASHSEED or the fixed seed)``."""
    return hash_function(algo)(DEFAULT_SEED if seed is None else seed)


def low64(digest: bytes) -> int:
    """The int form of a digest in events: its last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def event_hash(value: object) -> int | None:
    """A block hash from an event (int, or the raw digest bytes) as the int the index uses; None
    for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value & LOW64 if value >= 0 else None
    if isinstance(value, bytes | bytearray) and value:
        return low64(bytes(value))
    return None


class EngineChain:
    """vLLM's block-hash chain for one algorithm and seed; digests and their int forms."""

    __slots__ = ("_fn", "algo", "root")

    def __init__(self, algo: HashAlgo, seed: str | None = None) -> None:
        self.algo = algo
        self._fn = hash_function(algo)
        self.root = none_hash(algo, seed)

    def digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: tuple[Any, ...] | None = None,
        max_blocks: int | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The full digests of ``token_ids``' full blocks, continuing from ``parent`` (else the root).

        ``extra_keys`` is the same for every block (a LoRA name is ``(name,)``); None without any.
        """
        n = len(token_ids) // block_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        fn = self._fn
        h = parent or self.root
        out: list[bytes] = []
        append = out.append
        ids = list(token_ids)  # ints from numpy or array would pickle differently: vLLM hashes Python ints
        for start in range(0, n * block_size, block_size):
            h = fn((h, tuple(ids[start : start + block_size]), extra_keys))
            append(h)
        return out

    def hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: tuple[Any, ...] | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The int forms (as in events) of :meth:`digests`."""
        return [low64(d) for d in self.digests(token_ids, block_size, extra_keys, max_blocks)]


def content_chain(
    token_ids: Sequence[int],
    block_size: int,
    parent: int = CONTENT_SEED,
    max_blocks: int | None = None,
    extra: str = "",
) -> list[int]:
    """Our content hashes: block ``i`` is xxh3-64 of its token ids (as little-endian uint32) seeded
    with block ``i - 1``'s hash, the first seeded with ``parent`` (mixed with ``extra``, e.g. a
    LoRA name, so adapters do not share blocks)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    h = xxhash.xxh3_64_intdigest(extra.encode(), parent) if extra else parent
    out: list[int] = []
    data = array("I", token_ids[: n * block_size]).tobytes()
    step = block_size * 4
    xxh3 = xxhash.xxh3_64_intdigest
    for start in range(0, n * step, step):
        h = xxh3(data[start : start + step], h)
        out.append(h)
    return out
