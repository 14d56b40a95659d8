"""The affinity store shared by the workers of one ``extproc serve --workers N``: one host, no
network, its tables in one :class:`~extproc.state.shared_segment.SharedSegment` (which says how
they are laid out and why writers take no lock on the request path)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from extproc.routing.model import AffinityView
from extproc.state.shared_segment import WORD_MASK, SharedSegment
from extproc.state.store import StoreStats

_CORDONS = {1: "cordoned", 2: "drained"}
_CORDON_CODES = {v: k for k, v in _CORDONS.items()}


def session_hash(model: str, session_key: str) -> int:
    """The pin table's key for a session of ``model`` (never 0: 0 marks an empty slot)."""
    digest = hashlib.blake2b(f"{model}\x1f{session_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _conversation_hash(model: str, chain: int) -> int:
    """The pin table's key for a conversation's chain: a record separator keeps it from any
    session's key (a session key is never empty, so no session hashes to this text)."""
    return session_hash(f"\x1econversation\x1f{model}", f"{chain:x}")


class SharedMemoryStore:
    """The :class:`~extproc.state.store.AffinityStore` of several workers on one host.

    Same answers as :class:`~extproc.state.memory.MemoryStore`, with these differences: a
    replica's capacity bounds its blocks by stamp age (the last ``capacity`` blocks routed to it,
    counted across workers), sessions beyond the pin table's probe window evict the one soonest
    to expire rather than the least recently used, ``forget_replica`` leaves pins to the replica
    to expire (as Redis does: a pin to a non-candidate is passed over), and ``stats`` counts
    (block, replica) entries, not distinct blocks.
    """

    def __init__(self, segment: SharedSegment, ttl_s: float = 600.0, blocks_per_replica: int = 31_250) -> None:
        self.segment = segment
        self.ttl_s = ttl_s
        self.blocks_per_replica = blocks_per_replica

    def _held_after(self, row: int) -> int:
        seq, floor, cap, _ = self.segment.row_fields(row)
        return max(floor, seq - (cap or self.blocks_per_replica))

    def _pinned(self, session_key: str | None, model: str, now: float, refresh: bool) -> str | None:
        if not session_key:
            return None
        seg = self.segment
        key = session_hash(model, session_key)
        found = seg.pin_get(key, now)
        if found is None:
            return None
        at, row, gen = found
        names = seg.replicas()
        entry = next((name for r, name, g in names if r == row and g == gen), None)
        if entry is not None and refresh:
            seg.pin_put(key, row, gen, now + self.ttl_s, at)
        return entry

    def _leading(self, hashes: Sequence[int], row: int, above: int) -> tuple[int, int]:
        """How many leading blocks of ``hashes`` ``row`` took a stamp above ``above`` for, and the
        last of those blocks' stamp (0, 0 for none). Hashes are chained and a prompt's first
        blocks are stamped last, so this is a binary search, a few reads instead of one a block."""
        stamp_of = self.segment.prefix_stamp
        if not hashes or (first := stamp_of(hashes[0], row)) <= above:
            return 0, 0
        lo, hi, stamp = 0, len(hashes) - 1, first  # invariant: block lo is held, with stamp
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = stamp_of(hashes[mid], row)
            if found > above:
                lo, stamp = mid, found
            else:
                hi = mid - 1
        return lo + 1, stamp

    def _matches(self, hashes: Sequence[int]) -> dict[str, int]:
        result: dict[str, int] = {}
        for row, name, _ in self.segment.replicas() if hashes else ():
            held, _ = self._leading(hashes, row, self._held_after(row))
            if held:
                result[name] = held
        return result

    def _index(self, row: int, hashes: Sequence[int]) -> None:
        """Stamp ``hashes`` on ``row``, the last block first, so that a prompt's first blocks are
        the most recent, as in MemoryStore. A head still in the newer half of the replica's window
        is left as it is (a conversation's next turn resends every earlier block), and a short new
        tail is stamped just below it: what MemoryStore's order would be, a few writes instead of
        one a block."""
        seg = self.segment
        seq, floor, cap, _ = seg.row_fields(row)
        cap = cap or self.blocks_per_replica
        head, lowest = self._leading(hashes, row, max(floor, seq - cap // 2))
        tail = hashes[head:]
        held_after = [0] * seg.size.replicas
        for r, _, _ in seg.replicas():
            held_after[r] = self._held_after(r)
        # The tail's stamps sit below the head's and must stay held once the counter moved past them.
        if head and lowest - len(tail) > max(floor, seq + len(tail) - cap):
            seg.advance_seq(row, len(tail))
            for i, h in enumerate(tail):
                seg.prefix_put(h, row, lowest - 1 - i, held_after)
            return
        first = seg.advance_seq(row, len(hashes))
        for i, h in enumerate(reversed(hashes)):
            seg.prefix_put(h, row, first + i, held_after)

    async def lookup(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """Pinned replica (TTL refreshed) and prefix holders."""
        pinned = self._pinned(session_key, model, now, refresh=True)
        return AffinityView(pinned=pinned, prefix_matches=self._matches(prefix_hashes))

    async def peek(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """Pinned replica and prefix holders, without refreshing anything."""
        pinned = self._pinned(session_key, model, now, refresh=False)
        return AffinityView(pinned=pinned, prefix_matches=self._matches(prefix_hashes))

    async def record(
        self,
        session_key: str | None,
        replica: str,
        prefix_hashes: Sequence[int],
        now: float,
        pin: bool,
        *,
        model: str = "",
    ) -> None:
        """Pin and index."""
        seg = self.segment
        row = seg.row_of(replica, create=True)
        if row is None:
            return
        if session_key and pin:
            gen = next(g for r, _, g in seg.replicas() if r == row)
            seg.pin_put(session_hash(model, session_key), row, gen, now + self.ttl_s)
        if prefix_hashes:
            self._index(row, prefix_hashes)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound the blocks ``replica`` is believed to hold (its last ``blocks`` stamps)."""
        row = self.segment.row_of(replica, create=True)
        if row is not None:
            self.segment.set_row_fields(row, cap=max(1, min(blocks, self.blocks_per_replica)))

    async def forget_replica(self, replica: str) -> None:
        """Drop the replica's prefix entries and free its row (its pins then no longer resolve)."""
        seg = self.segment
        row = seg.row_of(replica)
        if row is None:
            return
        seq, _, _, cordon = seg.row_fields(row)
        seg.set_row_fields(row, floor=seq)
        if not cordon:  # a cordon outlives the replica's membership, as in the other stores
            seg.release_row(row)

    async def forget_session(self, session_key: str, *, model: str = "") -> bool:
        """Unpin the session."""
        found = self.segment.pin_get(session_hash(model, session_key), float("-inf"))
        if found is None:
            return False
        self.segment.pin_clear(found[0])
        return True

    async def conversation(self, turn: int, now: float, *, model: str = "", refresh: bool = True) -> int | None:
        """The conversation of the chain ``turn``, from the pin table."""
        key = _conversation_hash(model, turn)
        found = self.segment.pin_get(key, now)
        if found is None:
            return None
        at, high, low = found
        if refresh:
            self.segment.pin_put(key, high, low, now + self.ttl_s, at)
        return (high << 32) | low

    async def remember_conversation(self, end: int, conversation: int, now: float, *, model: str = "") -> None:
        """Map the chain ``end`` to ``conversation`` in the pin table: a slot whose row and
        generation fields hold the conversation's high and low 32 bits instead of a replica."""
        conversation &= WORD_MASK
        key = _conversation_hash(model, end)
        self.segment.pin_put(key, conversation >> 32, conversation & 0xFFFFFFFF, now + self.ttl_s)

    async def cordons(self) -> dict[str, str]:
        """Cordoned and drained replicas."""
        out = {}
        for row, name, _ in self.segment.replicas():
            code = self.segment.row_fields(row)[3]
            if code in _CORDONS:
                out[name] = _CORDONS[code]
        return out

    async def set_cordon(self, replica: str, state: str | None) -> None:
        """Cordon, drain or release."""
        row = self.segment.row_of(replica, create=state is not None)
        if row is not None:
            self.segment.set_row_fields(row, cordon=_CORDON_CODES[state] if state is not None else 0)

    def stats(self) -> StoreStats:
        """Pin slots taken and (block, replica) entries believed held."""
        seg = self.segment
        blocks = 0
        for row, _, _ in seg.replicas():
            seq, floor, cap, _ = seg.row_fields(row)
            blocks += max(0, min(seq - floor, cap or self.blocks_per_replica))
        return StoreStats(sessions=seg.pins_held(), prefix_blocks=blocks)

    async def close(self) -> None:
        """Nothing to release: the segment belongs to whoever attached it."""
