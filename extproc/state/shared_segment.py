"""The shared-memory segment of one ``extproc serve --workers N``: fixed-size tables every worker
reads and writes directly (``multiprocessing.shared_memory``), which
:class:`~extproc.state.shared_memory.SharedMemoryStore` and :mod:`extproc.fleet.health.shared_load` use:

- replica rows: name, a generation (bumped when a forgotten replica's row is reused), cordon
  state, and the prefix bookkeeping below;
- pins: open addressing over a 64-bit hash of (model, session key) -> replica row, generation,
  expiry; a conversation's chain (:mod:`extproc.request.conversation`) takes a pin slot too, its
  conversation in the row and generation fields;
- the prefix index: open addressing over (block hash, replica row) -> a stamp from that
  replica's counter. A replica holds a block while its stamp is among the last ``capacity``
  stamps it handed out (and newer than its last forget): a least-recently-routed bound without a
  shared list to keep in order;
- per-worker load rows (:mod:`extproc.fleet.health.shared_load`).

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

log = logging.getLogger("extproc.state")

WORD_MASK = (1 << 64) - 1
"""A 64-bit word: hashes, keys and stamps in the tables are this wide."""
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


def _pow2(n: int) -> int:
    return 1 << max(4, (max(1, n) - 1).bit_length())


def _mix(x: int) -> int:
    # splitmix64's finaliser: the probe start is the low bits, so every input bit must reach them.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & WORD_MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & WORD_MASK
    return (x ^ (x >> 31)) or 1


def _name_hash(encoded: bytes) -> int:
    return _mix(int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little"))


def _check(*fields: int | float) -> int:
    # Numbers hash the same in every process (hash randomisation covers str and bytes only).
    return hash(fields) & WORD_MASK


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
