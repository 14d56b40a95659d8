"""A session's engine block digests, kept from one turn to the next: a follow-up resends its whole
history, and only the blocks past what the previous turn hashed need hashing again."""

from __future__ import annotations

import threading
from collections import OrderedDict

from extproc.fleet.kvevents.hashing import EngineChain


class SessionDigests:
    """The last turn's token ids and digests of up to ``sessions`` sessions (at most ``max_blocks``
    blocks a prompt), least recent dropped first; safe to use from the tokenizing worker threads
    and the event loop at once."""

    def __init__(self, sessions: int = 4096, max_blocks: int = 2048) -> None:
        self.max_blocks = max_blocks
        self._hashes: OrderedDict[str, tuple[tuple[int, ...], list[bytes]]] = OrderedDict()
        self._cap = sessions
        self._lock = threading.Lock()

    def digests(
        self,
        ids: tuple[int, ...],
        session: str | None,
        lora: str | None,
        salt: str | None,
        bs: int,
        chain: EngineChain,
    ) -> list[bytes]:
        """The engine chain's digests, reusing a session's previous turn's leading blocks.

        Extra keys as vLLM's ``generate_block_hash_extra_keys`` builds them: a LoRA adapter's name
        in every block (the same tokens under two adapters, or an adapter and its base, never share
        a block), and the request's ``cache_salt`` after it in the first block only (the chain
        carries it to the rest)."""
        extra = (lora,) if lora else None
        reuse: list[bytes] = []
        if salt is not None and len(ids) >= bs:
            reuse = chain.digests(ids[:bs], bs, (*(extra or ()), salt))
        if session is not None:
            # Another adapter, salt, block size or algorithm: another chain (a layout learned from the
            # engines mid-conversation must not reuse digests of the old one).
            session = f"{lora or ''}\0{salt or ''}\0{bs}\0{chain.algo}\0{session}"
            with self._lock:
                prev = self._hashes.get(session)
            if prev is not None:
                prev_ids, prev_digests = prev
                k = min(len(prev_digests), len(ids) // bs)
                while k and ids[: k * bs] != prev_ids[: k * bs]:
                    k //= 2  # a turn that rewrote history: find a shorter shared run, cheaply
                if k > len(reuse):
                    reuse = prev_digests[:k]
        n = min(len(ids) // bs, self.max_blocks)
        tail = chain.digests(ids[len(reuse) * bs : n * bs], bs, extra, parent=reuse[-1] if reuse else None)
        digests = (reuse + tail)[:n]
        if session is not None:
            with self._lock:
                self._hashes[session] = (ids, digests)
                self._hashes.move_to_end(session)
                while len(self._hashes) > self._cap:
                    self._hashes.popitem(last=False)
        return digests
