"""The embedded in-memory affinity store for a single gateway: bounded, with a sliding TTL."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from extproc.routing.model import AffinityView
from extproc.state.store import StoreStats


class SessionMap:
    """session key -> replica, with a sliding TTL and an LRU bound on the number of sessions."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> str | None:
        """The pinned replica, refreshing the TTL; None if absent or expired."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        replica, expires = entry
        if expires <= now:
            del self._entries[key]
            return None
        self._entries[key] = (replica, now + self.ttl_s)
        self._entries.move_to_end(key)
        return replica

    def peek(self, key: str, now: float) -> str | None:
        """The pinned replica, leaving the TTL and the LRU order as they are."""
        entry = self._entries.get(key)
        return entry[0] if entry is not None and entry[1] > now else None

    def discard(self, key: str) -> bool:
        """Unpin ``key``; True if it was pinned."""
        return self._entries.pop(key, None) is not None

    def put(self, key: str, replica: str, now: float) -> None:
        """Pin ``key`` to ``replica``; evicts expired entries and then the least recently used."""
        self._entries[key] = (replica, now + self.ttl_s)
        self._entries.move_to_end(key)
        entries = self._entries
        # The oldest entries sit at the front: drop the expired ones there, then enforce the bound.
        while entries:
            _, (_, expires) = next(iter(entries.items()))
            if expires > now and len(entries) <= self.max_sessions:
                break
            entries.popitem(last=False)

    def drop_replica(self, replica: str) -> int:
        """Unpin every session on ``replica``; returns how many."""
        doomed = [k for k, (r, _) in self._entries.items() if r == replica]
        for k in doomed:
            del self._entries[k]
        return len(doomed)


class PrefixIndex:
    """Approximate prefix index: block hash -> replicas believed to hold it.

    Learned from the router's own decisions. Each replica keeps at most its capacity in blocks
    (``blocks_per_replica``, or what :meth:`set_capacity` gave it: the replica's own KV cache as it
    reports it), least recently routed evicted first, as its real cache would: what was sent there
    most recently survives, and a prefix the replica must have evicted is no longer claimed.

    The holders of a block are a bitmask (an int, one bit a replica) rather than a set: a full
    index holds hundreds of thousands of blocks, and sets are objects the garbage collector walks
    on every full collection (250,000 of them: a ~40 ms stall); ints are not.
    """

    def __init__(self, blocks_per_replica: int = 31_250) -> None:
        self.blocks_per_replica = blocks_per_replica
        self._owners: dict[int, int] = {}  # block hash -> bitmask of holders
        self._per_replica: dict[str, OrderedDict[int, None]] = {}
        self._bit: dict[str, int] = {}  # replica -> its bit
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._capacity: dict[str, int] = {}

    def capacity(self, replica: str) -> int:
        """How many blocks ``replica`` is believed able to hold."""
        return self._capacity.get(replica, self.blocks_per_replica)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound what ``replica`` is believed to hold to ``blocks`` (its least recent go now), never
        above ``blocks_per_replica``: that is the index's memory bound, whatever a replica reports."""
        self._capacity[replica] = max(1, min(blocks, self.blocks_per_replica))
        lru = self._per_replica.get(replica)
        bit = self._bit.get(replica)
        if lru is not None and bit is not None:
            self._trim(lru, bit, self._capacity[replica])

    def held(self, replica: str) -> int:
        """Blocks ``replica`` is believed to hold now."""
        lru = self._per_replica.get(replica)
        return len(lru) if lru is not None else 0

    def held_blocks(self, replica: str) -> list[int]:
        """The hashes ``replica`` is believed to hold, least recently used first."""
        return list(self._per_replica.get(replica, ()))

    def _trim(self, lru: OrderedDict[int, None], bit: int, capacity: int) -> None:
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            self._unset(old, bit)

    def __len__(self) -> int:
        return len(self._owners)

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica, how many leading blocks of ``hashes`` it holds (replicas with none omitted).

        Hashes are chained, and :meth:`add` keeps a prompt's first blocks the most recently used,
        so a replica that holds block ``i`` holds blocks ``0..i``: the longest match is found by
        binary search, a few lookups per replica instead of one per block.
        """
        if not hashes:
            return {}
        owners = self._owners
        first = owners.get(hashes[0], 0)
        if not first:
            return {}
        result: dict[str, int] = {}
        last = len(hashes) - 1
        for replica, bit in self._bit.items():
            if not first & bit:
                continue
            lo, hi = 0, last  # invariant: the replica holds block lo
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if owners.get(hashes[mid], 0) & bit:
                    lo = mid
                else:
                    hi = mid - 1
            result[replica] = lo + 1
        return result

    def add(self, replica: str, hashes: Sequence[int]) -> None:
        """Record that ``replica`` now holds ``hashes``."""
        lru = self._per_replica.get(replica)
        if lru is None:
            lru = self._per_replica[replica] = OrderedDict()
            self._bit[replica] = self._free_bits.pop() if self._free_bits else self._take_bit()
        bit = self._bit[replica]
        owners = self._owners
        # Last block first, so a prompt's first blocks end up the most recently used and are
        # evicted last, as a real prefix cache evicts a sequence's tail before its head.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            owners[h] = owners.get(h, 0) | bit
        self._trim(lru, bit, self._capacity.get(replica, self.blocks_per_replica))

    def _take_bit(self) -> int:
        bit, self._next_bit = self._next_bit, self._next_bit << 1
        return bit

    def _unset(self, h: int, bit: int) -> None:
        holders = self._owners.get(h, 0) & ~bit
        if holders:
            self._owners[h] = holders
        else:
            self._owners.pop(h, None)

    def drop_replica(self, replica: str) -> None:
        """Forget everything ``replica`` held."""
        lru = self._per_replica.pop(replica, None)
        bit = self._bit.pop(replica, None)
        if lru is None or bit is None:
            return
        for h in lru:
            self._unset(h, bit)
        self._free_bits.append(bit)


def _per_model(model: str, session_key: str) -> str:
    # A unit separator cannot come from a header; no model keeps the plain key (the common case).
    return f"{model}\x1f{session_key}" if model else session_key


class MemoryStore:
    """The :class:`~extproc.state.store.AffinityStore` kept in process memory (the default)."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000, blocks_per_replica: int = 31_250) -> None:
        self.sessions = SessionMap(ttl_s, max_sessions)
        self.prefixes = PrefixIndex(blocks_per_replica)
        # Conversations known by their message chains: bounded and expiring as the pins are.
        self.conversations = SessionMap(ttl_s, max_sessions)
        self._cordons: dict[str, str] = {}

    async def lookup(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """Pinned replica (TTL refreshed) and prefix holders."""
        pinned = self.sessions.get(_per_model(model, session_key), now) if session_key else None
        return AffinityView(pinned=pinned, prefix_matches=self.prefixes.matches(prefix_hashes))

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
        if session_key and pin:
            self.sessions.put(_per_model(model, session_key), replica, now)
        if prefix_hashes:
            self.prefixes.add(replica, prefix_hashes)

    def set_capacity(self, replica: str, blocks: int) -> None:
        """Bound the blocks ``replica`` is believed to hold (its KV cache, in prefix blocks)."""
        self.prefixes.set_capacity(replica, blocks)

    async def forget_replica(self, replica: str) -> None:
        """Drop the replica's prefix entries and pins."""
        self.prefixes.drop_replica(replica)
        self.sessions.drop_replica(replica)  # conversations stay: they name no replica

    async def peek(
        self, session_key: str | None, prefix_hashes: Sequence[int], now: float, *, model: str = ""
    ) -> AffinityView:
        """Pinned replica and prefix holders, without refreshing anything."""
        pinned = self.sessions.peek(_per_model(model, session_key), now) if session_key else None
        return AffinityView(pinned=pinned, prefix_matches=self.prefixes.matches(prefix_hashes))

    async def forget_session(self, session_key: str, *, model: str = "") -> bool:
        """Unpin the session."""
        return self.sessions.discard(_per_model(model, session_key))

    async def conversation(self, turn: int, now: float, *, model: str = "", refresh: bool = True) -> int | None:
        """The conversation the chain ``turn`` ended a request of."""
        key = _per_model(model, f"{turn:x}")
        found = self.conversations.get(key, now) if refresh else self.conversations.peek(key, now)
        return int(found, 16) if found is not None else None

    async def remember_conversation(self, end: int, conversation: int, now: float, *, model: str = "") -> None:
        """Map the chain ``end`` to ``conversation``."""
        self.conversations.put(_per_model(model, f"{end:x}"), f"{conversation:x}", now)

    async def cordons(self) -> dict[str, str]:
        """Cordoned and drained replicas."""
        return dict(self._cordons)

    async def set_cordon(self, replica: str, state: str | None) -> None:
        """Cordon, drain or release."""
        if state is None:
            self._cordons.pop(replica, None)
        else:
            self._cordons[replica] = state

    def stats(self) -> StoreStats:
        """Sessions held and prefix blocks indexed."""
        return StoreStats(sessions=len(self.sessions), prefix_blocks=len(self.prefixes))

    async def close(self) -> None:
        """Nothing to release."""
