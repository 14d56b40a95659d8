"""The prefix index fed by KV events: which replica holds which block, on which tier.

One :class:`ModelIndex` per model. A block is keyed by the engine's hash (int form) when the fleet's
hash is reproducible, else by our content hash of its token ids, with each replica's engine hashes
mapped to ours for removals. All replicas share one dict ``key -> holders``, the holders being an
int with three bits per replica slot (bit ``3s``: on the GPU, ``3s + 1``: in CPU memory,
``3s + 2``: on another tier, vLLM's ``STORAGE``), so:

- an entry costs one dict slot, one int key and (past two replica slots, beyond the interpreter's
  cached small ints) one more int: about 100 bytes (measured by ``benchmarks/kv_events.py``), plus
  one more dict entry per replica in content mode;
- the longest cached prefix of every replica comes from one walk down the request's chain that
  stops where the last replica's run ends: no scan of the index;
- a replica's removal touches only its blocks; clearing a replica (reset, restart, lost events)
  walks the index once, which happens rarely.

Data-parallel ranks: a vLLM server with ``--data-parallel-size`` N behind one address runs N
engines, each with its own prefix cache and its own event stream (``data_parallel_rank`` in every
batch), and its own load balancer picks the engine for each request: the router chooses the
replica, never the rank. So each (replica, rank) has its own slot: a rank's ``BlockRemoved``,
``AllBlocksCleared``, restart or lost events touch that rank's entries only, never a copy another
rank holds, and a replica's match is its best rank's (it holds a block if any rank does). That is
optimistic by design: whether the request lands on that rank is the server's choice, and the index
cannot do better without choosing ranks (a server with one rank is exact).

Tiers: vLLM's offloading connectors copy blocks to CPU memory or storage and say so
(``medium`` on ``BlockStored``/``BlockRemoved``). A tier's removal drops that tier's copy only: a
block evicted from the GPU while CPU memory holds it is still held, worth its tier's weight
(:class:`TierWeights`) in a match, and whole in :meth:`ModelIndex.holdings`' length (the engine
loads it instead of computing it, and reports it among its cached tokens). A copy announced twice
(vLLM's offloading events re-announce a hash shared by two chunks) is one copy here, and its first
removal drops it: an under-claim, never a claim of what is gone.

Speculative credit: between a decision and the replica's ``BlockStored``, the chosen replica is
credited with the prompt's blocks for a short TTL, so a burst of one prefix does not scatter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.fleet.kvevents.hashing import CONTENT_SEED, HashAlgo, content_chain
from extproc.fleet.kvevents.tiers import _TIER_BITS, DEFAULT_WEIGHTS, TierWeights, tier_of
from extproc.fleet.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event


@dataclass(slots=True)
class ApplyResult:
    """What applying a batch did, for metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    """Stored blocks whose parent is unknown in content mode (cannot be keyed)."""
    overflow: bool = False
    """The replica went over ``max_blocks_per_replica`` and was cleared."""


class ModelIndex:
    """Blocks per replica for one model (see the module's docstring)."""

    def __init__(
        self,
        algo: HashAlgo = HashAlgo.SHA256,
        max_blocks_per_replica: int = 1_000_000,
        speculative_ttl_s: float = 2.0,
        weights: TierWeights = DEFAULT_WEIGHTS,
    ) -> None:
        self.algo = algo
        self.max_blocks_per_replica = max_blocks_per_replica
        self.speculative_ttl_s = speculative_ttl_s
        self.weights = weights
        self._holders: dict[int, int] = {}
        self._slots: dict[tuple[str, int], int] = {}  # (replica, data-parallel rank) -> slot
        self._names: dict[int, str] = {}  # slot -> replica
        self._counts: dict[tuple[str, int], int] = {}
        self._engine_keys: dict[tuple[str, int], dict[int, int]] = {}  # content mode: engine hash -> our key
        self._spec: dict[int, int] = {}  # key -> slot bits credited speculatively
        self._spec_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()

    # -- replicas ---------------------------------------------------------------------------
    def _slot(self, replica: str, rank: int = 0) -> int:
        slot = self._slots.get((replica, rank))
        if slot is None:
            used = set(self._names)
            slot = next(i for i in range(len(used) + 1) if i not in used)
            self._slots[(replica, rank)] = slot
            self._names[slot] = replica
            self._counts[(replica, rank)] = 0
            self._engine_keys[(replica, rank)] = {}
        return slot

    def _ranks(self, replica: str, rank: int | None = None) -> list[tuple[str, int]]:
        return [k for k in self._slots if k[0] == replica and (rank is None or k[1] == rank)]

    def blocks(self, replica: str, rank: int | None = None) -> int:
        """How many (key, tier) entries ``replica`` has (on ``rank``, else over all its ranks)."""
        return sum(self._counts[k] for k in self._ranks(replica, rank))

    def ranks(self, replica: str) -> list[int]:
        """The data-parallel ranks of ``replica`` heard of."""
        return sorted(k[1] for k in self._ranks(replica))

    def __len__(self) -> int:
        return len(self._holders)

    def clear_replica(self, replica: str, rank: int | None = None) -> int:
        """Forget everything ``replica`` holds on ``rank`` (else on every rank): its cache was
        reset, or we lost track. Returns the number of entries dropped."""
        return sum(self._clear_slot(k) for k in self._ranks(replica, rank))

    def _clear_slot(self, who: tuple[str, int]) -> int:
        slot = self._slots[who]
        mask = ~(7 << (_TIER_BITS * slot))
        holders = self._holders
        for key in [k for k, v in holders.items() if v >> (_TIER_BITS * slot) & 7]:
            rest = holders[key] & mask
            if rest:
                holders[key] = rest
            else:
                del holders[key]
        self._clear_spec(slot, None)
        dropped = self._counts[who]
        self._counts[who] = 0
        self._engine_keys[who] = {}
        return dropped

    def drop_replica(self, replica: str) -> None:
        """``replica`` left the fleet: clear it and free its slots."""
        for who in self._ranks(replica):
            self._clear_slot(who)
            slot = self._slots.pop(who)
            del self._names[slot]
            del self._counts[who]
            del self._engine_keys[who]

    def replicas(self) -> list[str]:
        """The replicas this index has heard of."""
        return list(dict.fromkeys(k[0] for k in self._slots))

    # -- events -----------------------------------------------------------------------------
    def apply(self, replica: str, events: Iterable[Event], rank: int = 0) -> ApplyResult:
        """Apply one batch of ``replica``'s events (from its data-parallel ``rank``), in order."""
        result = ApplyResult()
        who = (replica, rank)
        slot = self._slot(replica, rank)
        for ev in events:
            if isinstance(ev, BlockStored):
                self._store(who, slot, ev, result)
            elif isinstance(ev, BlockRemoved):
                self._remove(who, slot, ev, result)
            elif isinstance(ev, AllBlocksCleared):
                result.cleared += self._clear_slot(who)
        if self._counts[who] > self.max_blocks_per_replica:
            # More than any engine holds: removals were lost. An index that cannot be trusted is
            # worse than none (the estimate takes over until the replica's next stores).
            self._clear_slot(who)
            result.overflow = True
        return result

    def _keys_for_store(self, replica: tuple[str, int], ev: BlockStored, result: ApplyResult) -> Sequence[int]:
        if self.algo is not HashAlgo.CONTENT:
            return ev.block_hashes
        mapping = self._engine_keys[replica]
        if ev.parent is None:
            parent = CONTENT_SEED
        else:
            known = mapping.get(ev.parent)
            if known is None:
                result.orphans += len(ev.block_hashes)
                return ()
            parent = known
        n = min(len(ev.block_hashes), len(ev.token_ids) // ev.block_size)
        try:
            keys = content_chain(ev.token_ids, ev.block_size, parent, n, extra=ev.lora_name or "")
        except (TypeError, OverflowError, ValueError):  # token ids that are not uint32
            result.orphans += len(ev.block_hashes)
            return ()
        for engine_hash, key in zip(ev.block_hashes, keys, strict=False):
            mapping[engine_hash] = key
        return keys

    def _store(self, replica: tuple[str, int], slot: int, ev: BlockStored, result: ApplyResult) -> None:
        bit = 1 << (_TIER_BITS * slot + tier_of(ev.medium))
        holders = self._holders
        added = 0
        for key in self._keys_for_store(replica, ev, result):
            old = holders.get(key, 0)
            if not old & bit:
                holders[key] = old | bit
                added += 1
        self._counts[replica] += added
        result.stored += added

    def _remove(self, replica: tuple[str, int], slot: int, ev: BlockRemoved, result: ApplyResult) -> None:
        tier = tier_of(ev.medium)
        bit = 1 << (_TIER_BITS * slot + tier)
        mine = 7 << (_TIER_BITS * slot)
        holders = self._holders
        mapping = self._engine_keys[replica] if self.algo is HashAlgo.CONTENT else None
        removed = 0
        spec_keys = []
        for engine_hash in ev.block_hashes:
            if mapping is not None:
                key = mapping.get(engine_hash)
                if key is None:
                    continue
            else:
                key = engine_hash
            old = holders.get(key, 0)
            left = old & ~bit
            if old & bit:
                removed += 1
                if left:
                    holders[key] = left
                else:
                    del holders[key]
            # Content mode: the engine's hash keeps its key while another tier holds the block,
            # so that tier's removal, and a child stored under it, still find it.
            if mapping is not None and not left & mine:
                del mapping[engine_hash]
            if tier == 0:
                spec_keys.append(key)
        self._counts[replica] -= removed
        result.removed += removed
        if self._spec:
            self._clear_spec(slot, spec_keys)

    # -- speculative credit -----------------------------------------------------------------
    def credit(self, replica: str, keys: Sequence[int], now: float) -> None:
        """Count ``keys`` as held on the GPU of ``replica`` until ``now + speculative_ttl_s`` (or
        until the replica removes them). Credited to rank 0: the server picks the rank, and a
        replica's match is its best rank's."""
        if not keys or self.speculative_ttl_s <= 0:
            return
        self._expire(now)
        bit = 1 << (_TIER_BITS * self._slot(replica))
        spec = self._spec
        for key in keys:
            spec[key] = spec.get(key, 0) | bit
        self._spec_queue.append((now + self.speculative_ttl_s, bit, tuple(keys)))

    def _expire(self, now: float) -> None:
        queue, spec = self._spec_queue, self._spec
        while queue and queue[0][0] <= now:
            _, bit, keys = queue.popleft()
            for key in keys:
                v = spec.get(key, 0) & ~bit
                if v:
                    spec[key] = v
                else:
                    spec.pop(key, None)

    def _clear_spec(self, slot: int, keys: Sequence[int] | None) -> None:
        bit = 1 << (_TIER_BITS * slot)
        spec = self._spec
        for key in list(spec) if keys is None else keys:
            v = spec.get(key)
            if v is not None and v & bit:
                if v & ~bit:
                    spec[key] = v & ~bit
                else:
                    del spec[key]

    # -- lookups ----------------------------------------------------------------------------
    def matches(self, keys: Sequence[int], now: float, replicas: Iterable[str] | None = None) -> dict[str, float]:
        """Per replica, its longest run of ``keys`` from the first, in GPU-block equivalents (a
        block held only on a slower tier counts its tier's weight). Only ``replicas`` (default:
        all known) are considered; replicas without a match are left out."""
        return {name: weighted for name, (_, weighted) in self.holdings(keys, now, replicas).items()}

    def holdings(
        self, keys: Sequence[int], now: float, replicas: Iterable[str] | None = None
    ) -> dict[str, tuple[int, float]]:
        """Per replica, its longest run of ``keys`` from the first held on any tier, in blocks,
        and the same run weighed by tier (:meth:`matches`); its best rank's. Replicas without a
        match are left out."""
        self._expire(now)
        names = None if replicas is None else set(replicas)
        wanted = [slot for (r, _), slot in self._slots.items() if names is None or r in names]
        open_ = 0
        for slot in wanted:
            open_ |= 1 << (_TIER_BITS * slot)
        if not open_:
            return {}
        even = open_  # the GPU bits of the replicas asked about
        holders_get, spec_get = self._holders.get, self._spec.get
        has_spec = bool(self._spec)
        ends: dict[int, int] = {}
        cpu_only: dict[int, int] = {}
        storage_only: dict[int, int] = {}
        for i, key in enumerate(keys):
            bits = holders_get(key, 0)
            if has_spec:
                bits |= spec_get(key, 0)
            gpu = bits & even
            cpu = (bits >> 1) & even
            present = (gpu | cpu | (bits >> 2)) & open_
            if present != open_:
                gone = open_ & ~present
                for slot in _slots_of(gone):
                    ends[slot] = i
                open_ = present
                if not open_:
                    break
            slow = open_ & ~gpu
            if slow:
                for slot in _slots_of(slow & cpu):
                    cpu_only[slot] = cpu_only.get(slot, 0) + 1
                for slot in _slots_of(slow & ~cpu):
                    storage_only[slot] = storage_only.get(slot, 0) + 1
        else:
            for slot in _slots_of(open_):
                ends[slot] = len(keys)
        w = self.weights
        out: dict[str, tuple[int, float]] = {}
        for slot, length in ends.items():
            if length:
                name = self._names[slot]
                # Blocks past a replica's run were counted while it was open: only those in it count.
                weighted = (
                    length
                    - (1.0 - w.cpu) * min(cpu_only.get(slot, 0), length)
                    - (1.0 - w.storage) * min(storage_only.get(slot, 0), length)
                )
                best = out.get(name)
                if best is None or weighted > best[1]:
                    out[name] = (max(length, best[0]) if best else length, weighted)
                elif length > best[0]:
                    out[name] = (length, best[1])
        return out


def _slots_of(bits: int) -> Iterable[int]:
    """The replica slots whose GPU bit is set in ``bits`` (every third bit position)."""
    while bits:
        low = bits & -bits
        yield (low.bit_length() - 1) // _TIER_BITS
        bits ^= low


class KvIndex:
    """The index of every model; the model a topic names (``kv@<replica>@<model>``), else ``""``."""

    def __init__(
        self,
        algos: Mapping[str, HashAlgo] | None = None,
        default_algo: HashAlgo = HashAlgo.SHA256,
        max_blocks_per_replica: int = 1_000_000,
        speculative_ttl_s: float = 2.0,
        weights: TierWeights = DEFAULT_WEIGHTS,
    ) -> None:
        self._algos = dict(algos or {})
        self.default_algo = default_algo
        self.max_blocks_per_replica = max_blocks_per_replica
        self.speculative_ttl_s = speculative_ttl_s
        self.weights = weights
        self.models: dict[str, ModelIndex] = {}

    def model(self, model: str) -> ModelIndex:
        """The index of ``model`` (created on first use)."""
        idx = self.models.get(model)
        if idx is None:
            algo = self._algos.get(model, self.default_algo)
            idx = ModelIndex(algo, self.max_blocks_per_replica, self.speculative_ttl_s, self.weights)
            self.models[model] = idx
        return idx

    def for_request(self, model: str) -> ModelIndex | None:
        """The index that answers for requests to ``model``: its own, else the one events that
        name no model feed."""
        idx = self.models.get(model)
        return idx if idx is not None else self.models.get("")

    def clear_replica(self, replica: str, rank: int | None = None) -> int:
        """Forget ``replica`` (its ``rank``, else all) in every model."""
        return sum(idx.clear_replica(replica, rank) for idx in self.models.values())

    def drop_replica(self, replica: str) -> None:
        """``replica`` left: forget it everywhere."""
        for idx in self.models.values():
            idx.drop_replica(replica)

    def blocks(self, replica: str) -> int:
        """Entries held by ``replica`` over all models."""
        return sum(idx.blocks(replica) for idx in self.models.values())

    def __len__(self) -> int:
        return sum(len(idx) for idx in self.models.values())
