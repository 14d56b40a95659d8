"""The affinity store shared by the workers of one ``extproc serve --workers N``: one host, no network.

One :class:`SharedSegment` (``multiprocessing.shared_memory``) holds fixed-size tables every
worker reads and writes directly:

- replica rows: name, a generation (bumped when a forgotten replica's row is reused), cordon
  state, and the prefix bookkeeping below;
- pins: open addressing over a 64-bit hash of (model, session key) -> replica row, generation,
  expiry; a conversation's chain (:mod:`extproc.request.conversation`) takes a pin slot too, its
  conversation in the row and generation fields;
- the prefix index: open addressing over (block hash, replica row) -> a stamp from that
  replica's counter. A replica holds a block while its stamp is among the last ``capacity``
  stamps it handed out (and newer than its last forget): a least-recently-routed bound without a
  shared list to keep in order;
- per-worker load rows (:mod:`extproc.health.shared_load`).

Writers take no lock on the request path. Each slot carries a check word computed from its
fields; a slot torn by a reader racing a writer, or by two writers racing each other, fails the
check and reads as a miss, which the router already handles (missing evidence is a miss, never
a crash). Replica registration, rare, takes a lock shared by the workers. Counters that two
workers race on (a replica's stamp counter) may lose an increment: blocks then share a stamp,
which only blurs the eviction order by a block.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from extproc.routing.model import AffinityView
from extproc.state.store import StoreStats

log = logging.getLogger("extproc.state")

_MASK = (1 << 64) - 1
_MAGIC = 0x65787470726F6331  # "extproc1"
_PROBE = 8  # slots a key may live in: a lookup reads them all, so deleting needs no tombstone
_NAME_BYTES = 96
_LOCK_TIMEOUT_S = 1.0

_HEADER = struct.Struct("<QQQQQQ")  # magic, replica rows, pin slots, prefix slots, workers, epoch
_EPOCH_OFFSET = 5 * 8
_ROW = struct.Struct(f"<QQIIQQQI{_NAME_BYTES}s4x")  # name hash, seq, gen, cordon, floor, cap, used, len, name
_ROW_SEQ = struct.Struct("<Q")  # one counter: a row's stamps, the header's epoch
_PIN = struct.Struct("<QdIIQ")  # key, expiry, replica row, generation, check
_PREFIX = struct.Struct("<QQII8x")  # key, stamp, replica row, check (low 32 bits of _check)
_PREFIX_SIZE = _PREFIX.size
LOAD_FIELDS = struct.Struct("<qqqqdd")
"""One worker's load on one replica: in flight, in-flight tokens, pending prefill, requests,
recent (decayed), when recent was last bumped."""

_CORDONS = {1: "cordoned", 2: "drained"}
_CORDON_CODES = {v: k for k, v in _CORDONS.items()}


def _pow2(n: int) -> int:
    return 1 << max(4, (max(1, n) - 1).bit_length())


def _mix(x: int) -> int:
    # splitmix64's finaliser: the probe start is the low bits, so every input bit must reach them.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return (x ^ (x >> 31)) or 1


def session_hash(model: str, session_key: str) -> int:
    """The pin table's key for a session of ``model`` (never 0: 0 marks an empty slot)."""
    digest = hashlib.blake2b(f"{model}\x1f{session_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _conversation_hash(model: str, chain: int) -> int:
    """The pin table's key for a conversation's chain: a record separator keeps it from any
    session's key (a session key is never empty, so no session hashes to this text)."""
    return session_hash(f"\x1econversation\x1f{model}", f"{chain:x}")


def _name_hash(encoded: bytes) -> int:
    return _mix(int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little"))


def _check(*fields: int | float) -> int:
    # Numbers hash the same in every process (hash randomisation covers str and bytes only).
    return hash(fields) & _MASK


@dataclass(frozen=True, slots=True)
class SegmentSize:
    """How big the tables are: fixed when the segment is created."""

    replicas: int = 32
    """Replica rows; a replica beyond them is routed without affinity (never indexed or pinned)."""
    pin_slots: int = 1 << 18
    prefix_slots: int = 1 << 20
    workers: int = 1

    @classmethod
    def for_config(cls, max_sessions: int, blocks_per_replica: int, replicas: int, workers: int) -> SegmentSize:
        """Tables at most half full with ``max_sessions`` pins and ``blocks_per_replica`` blocks on
        each of ``replicas`` replicas."""
        return cls(replicas, _pow2(2 * max_sessions), _pow2(2 * blocks_per_replica * replicas), workers)

    @property
    def nbytes(self) -> int:
        """The segment's size in bytes."""
        rows = self.replicas * (_ROW.size + self.workers * LOAD_FIELDS.size)
        return _HEADER.size + rows + self.pin_slots * _PIN.size + self.prefix_slots * _PREFIX.size


class SharedSegment:
    """The tables in one shared-memory segment: created by the parent, attached by each worker."""

    def __init__(self, shm: SharedMemory, lock: Any, owner: bool) -> None:
        self.shm = shm
        self.lock = lock
        self.owner = owner
        buf = shm.buf
        assert buf is not None
        self.buf = buf
        magic, replicas, pins, prefixes, workers, _ = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC:
            raise ValueError(f"shared memory {shm.name}: not an extproc segment")
        self.size = SegmentSize(replicas, pins, prefixes, workers)
        self.rows_at = _HEADER.size
        self.load_at = self.rows_at + replicas * _ROW.size
        self.pins_at = self.load_at + replicas * workers * LOAD_FIELDS.size
        self.prefix_at = self.pins_at + pins * _PIN.size
        self._epoch = -1
        self._names: list[tuple[str, int] | None] = []  # row -> (name, generation), None when free
        self._rows: dict[str, int] = {}

    @classmethod
    def create(cls, size: SegmentSize, lock: Any = None) -> SharedSegment:
        """A new zeroed segment (the caller :meth:`close` s it, which unlinks it)."""
        shm = SharedMemory(create=True, size=size.nbytes)
        assert shm.buf is not None
        _HEADER.pack_into(shm.buf, 0, _MAGIC, size.replicas, size.pin_slots, size.prefix_slots, size.workers, 0)
        return cls(shm, lock if lock is not None else multiprocessing.get_context("spawn").Lock(), owner=True)

    @classmethod
    def attach(cls, name: str, lock: Any) -> SharedSegment:
        """The segment ``name`` another process created."""
        return cls(SharedMemory(name=name), lock, owner=False)

    @property
    def name(self) -> str:
        """The segment's system-wide name (what :meth:`attach` takes)."""
        return self.shm.name

    def close(self) -> None:
        """Detach; the creator also unlinks it."""
        self.buf.release()
        self.shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()

    # --- replica rows -------------------------------------------------------------------------

    def _row_at(self, row: int) -> int:
        return self.rows_at + row * _ROW.size

    def _read_row(self, row: int) -> tuple[Any, ...]:
        return _ROW.unpack_from(self.buf, self._row_at(row))

    def _refresh(self) -> None:
        (epoch,) = _ROW_SEQ.unpack_from(self.buf, _EPOCH_OFFSET)
        if epoch == self._epoch:
            return
        names: list[tuple[str, int] | None] = []
        for row in range(self.size.replicas):
            name_hash, _, gen, _, _, _, used, length, raw = self._read_row(row)
            name = raw[:length].decode(errors="replace")
            live = used and name_hash == _name_hash(raw[:length])
            names.append((name, gen) if live else None)
        self._names = names
        self._rows = {entry[0]: row for row, entry in enumerate(names) if entry is not None}
        self._epoch = epoch

    def replicas(self) -> list[tuple[int, str, int]]:
        """Every replica with a row: (row, name, generation)."""
        self._refresh()
        return [(row, entry[0], entry[1]) for row, entry in enumerate(self._names) if entry is not None]

    def row_of(self, name: str, create: bool = False) -> int | None:
        """``name``'s row; with ``create`` one is taken for it (None when the rows are full)."""
        self._refresh()
        row = self._rows.get(name)
        if row is not None or not create:
            return row
        encoded = name.encode()[:_NAME_BYTES]
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            return None  # a worker died holding it: route this replica without affinity
        try:
            self._epoch = -1
            self._refresh()  # another worker may have taken one for it meanwhile
            row = self._rows.get(name)
            if row is not None:
                return row
            free = [r for r, entry in enumerate(self._names) if entry is None]
            if not free:
                log.warning("shared store: all %d replica rows taken, %s has no affinity", len(self._names), name)
                return None
            row = free[0]
            _, seq, gen, _, _, _, used, _, _ = self._read_row(row)
            name_hash = _name_hash(encoded)
            # A reused row starts empty: its old stamps fall below the floor, its old pins carry
            # the old generation.
            gen = gen + 1 if used else gen
            _ROW.pack_into(self.buf, self._row_at(row), name_hash, seq, gen, 0, seq, 0, 1, len(encoded), encoded)
            self._bump_epoch()
            self._refresh()
            return row
        finally:
            self.lock.release()

    def _bump_epoch(self) -> None:
        (epoch,) = _ROW_SEQ.unpack_from(self.buf, _EPOCH_OFFSET)
        _ROW_SEQ.pack_into(self.buf, _EPOCH_OFFSET, epoch + 1)

    def release_row(self, row: int) -> None:
        """Free ``row`` for another replica (its prefix entries are dropped by the floor)."""
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            return
        try:
            at = self._row_at(row)
            fields = list(_ROW.unpack_from(self.buf, at))
            fields[0] = 0  # no name: free
            _ROW.pack_into(self.buf, at, *fields)
            self._bump_epoch()
        finally:
            self.lock.release()

    def row_fields(self, row: int) -> tuple[int, int, int, int]:
        """(stamp counter, floor, capacity, cordon code) of ``row``."""
        _, seq, _, cordon, floor, cap, _, _, _ = self._read_row(row)
        return seq, floor, cap, cordon

    def set_row_fields(
        self, row: int, *, floor: int | None = None, cap: int | None = None, cordon: int | None = None
    ) -> None:
        """Write some of a row's counters (the name, generation and stamp counter stay)."""
        at = self._row_at(row)
        f = list(_ROW.unpack_from(self.buf, at))
        if cordon is not None:
            f[3] = cordon
        if floor is not None:
            f[4] = floor
        if cap is not None:
            f[5] = cap
        _ROW.pack_into(self.buf, at, *f)

    def advance_seq(self, row: int, count: int) -> int:
        """Take ``count`` stamps from ``row``'s counter; returns the first (racing workers may share some)."""
        at = self._row_at(row) + 8
        (seq,) = _ROW_SEQ.unpack_from(self.buf, at)
        _ROW_SEQ.pack_into(self.buf, at, seq + count)
        return int(seq) + 1

    # --- pins ----------------------------------------------------------------------------------

    def _pin_slots(self, key: int) -> range:
        start = key & (self.size.pin_slots - 1)
        return range(start, start + _PROBE)

    def _pin_at(self, slot: int) -> int:
        return int(self.pins_at + (slot & (self.size.pin_slots - 1)) * _PIN.size)

    def pin_get(self, key: int, now: float) -> tuple[int, int, int] | None:
        """(slot offset, row, generation) of ``key``'s live pin; None: absent, expired or torn."""
        for slot in self._pin_slots(key):
            at = self._pin_at(slot)
            k, expiry, row, gen, check = _PIN.unpack_from(self.buf, at)
            if k == key and check == _check(k, expiry, row, gen):
                return (at, row, gen) if expiry > now else None
        return None

    def pin_put(self, key: int, row: int, gen: int, expiry: float, at: int | None = None) -> None:
        """Pin ``key``: over its own slot, else an empty or expired one, else the soonest to expire."""
        if at is None:
            victim, soonest = None, float("inf")
            for slot in self._pin_slots(key):
                offset = self._pin_at(slot)
                k, exp, r, g, check = _PIN.unpack_from(self.buf, offset)
                valid = k != 0 and check == _check(k, exp, r, g)
                if k == key or not valid:
                    victim = offset
                    break
                if exp < soonest:
                    victim, soonest = offset, exp
            at = victim
        assert at is not None
        _PIN.pack_into(self.buf, at, key, expiry, row, gen, _check(key, expiry, row, gen))

    def pin_clear(self, at: int) -> None:
        """Empty the pin slot at ``at``."""
        _PIN.pack_into(self.buf, at, 0, 0.0, 0, 0, 0)

    def pins_held(self) -> int:
        """Slots holding a pin (expired ones included until overwritten)."""
        # Views released at once: a segment with a view still exported cannot be closed.
        with self.buf[self.pins_at : self.prefix_at] as region, region.cast("Q") as words:
            keys = words[:: _PIN.size // 8].tolist()
        return len(keys) - keys.count(0)

    # --- prefix index ----------------------------------------------------------------------------

    def prefix_stamp(self, block: int, row: int) -> int:
        """The stamp ``row`` last took for ``block``; 0 when absent or torn."""
        key = _mix(block * 0x9E3779B97F4A7C15 + row)
        buf, unpack, base, mask = self.buf, _PREFIX.unpack_from, self.prefix_at, self.size.prefix_slots - 1
        for i in range(_PROBE):
            k, stamp, r, check = unpack(buf, base + ((key + i) & mask) * _PREFIX_SIZE)
            if k == key and r == row:
                return int(stamp) if check == hash((k, stamp, r)) & 0xFFFFFFFF else 0
            if k == 0:  # slots are taken first to last and never emptied: the key is not further on
                return 0
        return 0

    def prefix_put(self, block: int, row: int, stamp: int, held_after: Sequence[int]) -> None:
        """Record ``row`` took ``stamp`` for ``block``. ``held_after[r]``: stamps of row ``r`` at or
        below it are no longer held, so their slots are free to take."""
        key = _mix(block * 0x9E3779B97F4A7C15 + row)
        buf, unpack, base, mask = self.buf, _PREFIX.unpack_from, self.prefix_at, self.size.prefix_slots - 1
        victim, oldest = base + (key & mask) * _PREFIX_SIZE, None
        for i in range(_PROBE):
            at = base + ((key + i) & mask) * _PREFIX_SIZE
            k, s, r, check = unpack(buf, at)
            if k in (key, 0) or check != hash((k, s, r)) & 0xFFFFFFFF:
                victim = at
                break
            age = s - held_after[r] if r < len(held_after) else -1
            if age <= 0:
                victim = at
                break
            if oldest is None or age < oldest:
                victim, oldest = at, age
        _PREFIX.pack_into(buf, victim, key, stamp, row, hash((key, stamp, row)) & 0xFFFFFFFF)


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
        conversation &= _MASK
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
