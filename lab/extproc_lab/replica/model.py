"""A pure model of one vLLM replica: KV blocks with a prefix cache, continuous batching, preemption.

No I/O and no clock: drivers hand it requests and step it.

- :class:`ReplicaEngine <extproc_lab.replica.engine.ReplicaEngine>` (the fake replica's HTTP server)
  runs one step at a time and sleeps for its duration, in real or scaled time;
- the simulator (:mod:`extproc_lab.sim`) runs the same steps on a virtual clock, and compresses runs
  of identical decode steps into one event (:meth:`ReplicaModel.begin_step` with ``max_steps``).

What it models, following vLLM's V1 scheduler:

- **KV blocks** (:class:`KVPool`): ``num_gpu_blocks`` blocks of ``block_size`` tokens. Full
  blocks (the prompt's, and the answer's where the driver knows its keys) are cached under their
  prefix key and shared by every sequence that references them;
  a cached block no sequence references stays cached but is *free*, and free cached blocks are
  evicted least recently freed first when blocks are needed (a sequence frees its blocks tail
  first, so a shared head outlives the tails). Usage (``kv_cache_usage_perc``) counts the blocks
  referenced by sequences, as vLLM's does: a warm but idle cache reads 0.
- **Continuous batching**: every step first gives each running sequence its next tokens (one to
  decode, or the next chunk of its prompt), then admits waiting sequences first come first
  served, within ``max_num_batched_tokens`` tokens and ``max_running`` sequences. An admitted
  prompt starts after its longest cached prefix that ends before its last token (that one is
  always computed): only uncached tokens are computed.
- **Preemption**: when a running sequence needs a block and none is free, the most recently
  admitted sequence is preempted (its blocks are released, it goes back to the head of the
  queue and recomputes its prompt and output so far when readmitted), as vLLM's recompute mode.
- **Counters** in vLLM's terms: queue and running counts, prefix-cache queries and hits (tokens),
  prompt and generation tokens, preemptions, finished requests by reason, TTFT and end-to-end
  latency histograms.

Prompts are described by their *keys*: the prefix hashes of their full blocks (each key covers
``key_span`` tokens, the last one ``tail_span``), so equal prefixes share keys. The HTTP replica
uses one key per 16-token block (the router's hashes); a trace replay may use coarser keys (a
Mooncake ``hash_id`` covers 512 tokens) to keep the simulator fast.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc_lab.replica.offload import CpuTier
from extproc_lab.replica.timing import ReplicaProfile

# vLLM's own bucket bounds, so dashboards built for vLLM read these histograms unchanged.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort")

WAITING, RUNNING, DONE, ABORTED = 0, 1, 2, 3


@dataclass(slots=True)
class LatencyHistogram:
    """Bucketed observations with Prometheus semantics (``le`` bounds, cumulative on output)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            # One slot per bound plus the +Inf overflow.
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of observations <= le)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


class PoolListener(Protocol):
    """Told of the pool's cache changes (the fake replica's KV events)."""

    def stored(self, key: int) -> None:
        """An entry was cached."""
        ...

    def evicted(self, key: int) -> None:
        """An entry was evicted."""
        ...

    def cleared(self) -> None:
        """Every entry was evicted."""
        ...


class KVPool:
    """The replica's KV blocks: cached prefix entries (shared, reference counted) and private blocks.

    An entry is one key covering ``size`` blocks. Entries with no reference are *free*: still
    cached, evictable, kept in least-recently-freed order. Private blocks hold what is not a full
    cached prompt block (a prompt's partial last block, output tokens).
    """

    __slots__ = (
        "_free",
        "_refs",
        "_size",
        "block_size",
        "cached_blocks",
        "free_cached_blocks",
        "listener",
        "num_blocks",
        "offload",
        "private_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        # Oldest first: popitem(last=False) is the eviction.
        self._free: OrderedDict[int, None] = OrderedDict()
        self.cached_blocks = 0
        self.free_cached_blocks = 0
        self.private_blocks = 0
        # Told of every store, eviction and reset (the fake replica publishes them as KV events).
        self.listener: PoolListener | None = None
        # CPU memory behind it (vLLM's offloading connector): every entry cached is copied there.
        self.offload: CpuTier | None = None

    def __len__(self) -> int:
        """Blocks holding cached prefix entries (referenced or free)."""
        return self.cached_blocks

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    @property
    def referenced(self) -> bool:
        """Whether some cached entry is in use by a sequence."""
        return any(self._refs.values())

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by sequences: what ``kv_cache_usage_perc`` counts."""
        return self.cached_blocks - self.free_cached_blocks + self.private_blocks

    @property
    def available_blocks(self) -> int:
        """Blocks a sequence could get now: empty ones plus free cached ones (by eviction)."""
        return self.num_blocks - self.used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences, in [0, 1]."""
        return min(1.0, self.used_blocks / self.num_blocks)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached (a prefix is only reusable whole)."""
        refs = self._refs
        n = 0
        for k in keys:
            if k not in refs:
                break
            n += 1
        return n

    def size_of(self, key: int) -> int:
        """Blocks of a cached entry (0 if absent)."""
        return self._size.get(key, 0)

    def is_free(self, key: int) -> bool:
        """Whether a cached entry is referenced by no sequence (and so evictable)."""
        return self._refs.get(key) == 0

    def acquire(self, key: int) -> None:
        """Reference a cached entry (it stops being evictable)."""
        refs = self._refs[key]
        if refs == 0:
            del self._free[key]
            self.free_cached_blocks -= self._size[key]
        self._refs[key] = refs + 1

    def release(self, keys: Iterable[int]) -> None:
        """Drop one reference to each of ``keys``; pass a prompt's keys tail first, so that of what
        it frees, its tail is evicted first."""
        refs = self._refs
        free = self._free
        size = self._size
        for key in keys:
            r = refs[key] - 1
            refs[key] = r
            if r == 0:
                free[key] = None
                self.free_cached_blocks += size[key]

    def _make_room(self, blocks: int) -> bool:
        """Evict free entries until ``blocks`` empty blocks exist; False (nothing evicted) if impossible."""
        if blocks > self.available_blocks:
            return False
        empty = self.num_blocks - self.cached_blocks - self.private_blocks
        free = self._free
        while empty < blocks:
            key, _ = free.popitem(last=False)
            size = self._size.pop(key)
            del self._refs[key]
            self.cached_blocks -= size
            self.free_cached_blocks -= size
            empty += size
            if self.listener is not None:
                self.listener.evicted(key)
        return True

    def insert(self, key: int, blocks: int) -> bool:
        """Cache a newly computed entry, referenced once; False if no room (nothing changed)."""
        if not self._make_room(blocks):
            return False
        self._refs[key] = 1
        self._size[key] = blocks
        self.cached_blocks += blocks
        if self.listener is not None:
            self.listener.stored(key)
        if self.offload is not None:
            self.offload.store(key, blocks)
        return True

    def grow_private(self, blocks: int) -> bool:
        """Take ``blocks`` more private blocks (negative gives them back); False if no room."""
        if blocks > 0 and not self._make_room(blocks):
            return False
        self.private_blocks += blocks
        return True

    def reset(self) -> int:
        """Evict every free entry (vLLM's ``/reset_prefix_cache``; referenced entries stay until
        released). Returns the blocks evicted."""
        evicted = 0
        keys = []
        while self._free:
            key, _ = self._free.popitem(last=False)
            size = self._size.pop(key)
            del self._refs[key]
            evicted += size
            keys.append(key)
        self.cached_blocks -= evicted
        self.free_cached_blocks -= evicted
        if self.listener is not None:
            if not self._refs:
                self.listener.cleared()
            else:  # entries in use stay: what went is told block by block
                for key in keys:
                    self.listener.evicted(key)
        return evicted


@dataclass(slots=True, eq=False)
class Seq:
    """One request inside a replica: what it asks for and how far it got.

    ``keys`` are the prefix keys of the sequence's full blocks; key ``i`` covers ``key_span``
    tokens except the last, which covers ``tail_span`` (both multiples of the block size). They
    cover the prompt, and may go on over the output where the driver knows what the answer will
    be (a conversation's next turn resends it): vLLM caches every full block it computed, the
    answer's too, so the next turn finds them.
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    keys: Sequence[int] = ()
    key_span: int = 16
    tail_span: int = 16
    finish_reason: str = "length"
    handle: Any = None
    state: int = WAITING
    arrived_at: float = 0.0
    computed: int = 0
    generated: int = 0
    held: int = 0
    private: int = 0
    prefilling: bool = True
    cached_tokens: int = -1
    prefill_tokens: int = 0
    first_token_at: float = -1.0
    last_token_at: float = -1.0
    finished_at: float = -1.0
    preemptions: int = 0
    unbounded: bool = False

    def key_end(self, count: int) -> int:
        """Tokens covered by the first ``count`` keys."""
        if count <= 0:
            return 0
        n = len(self.keys)
        if count >= n:
            return (n - 1) * self.key_span + self.tail_span
        return count * self.key_span

    def key_blocks(self, index: int, block_size: int) -> int:
        """Blocks of key ``index``."""
        span = self.tail_span if index == len(self.keys) - 1 else self.key_span
        return span // block_size

    @property
    def covered(self) -> int:
        """Tokens covered by every key of the prompt."""
        return self.key_end(len(self.keys))


@dataclass(slots=True)
class StepResult:
    """What one step (or one run of decode steps) produced, at its end."""

    end: float
    steps: int
    emitted: list[Seq]
    first: list[Seq]
    finished: list[Seq]
    tokens: int = 0


class ReplicaModel:
    """The state of one replica and its scheduler; see the module docstring."""

    def __init__(self, profile: ReplicaProfile) -> None:
        self.profile = profile
        self.pool = KVPool(profile.num_gpu_blocks, profile.block_size)
        if profile.cpu_offload_blocks:
            self.pool.offload = CpuTier(profile.cpu_offload_blocks)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        # Counters, in vLLM's terms.
        self.preemptions = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefill_tokens_computed = 0
        self.busy_s = 0.0
        self.steps = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.e2e = LatencyHistogram(E2E_BUCKETS)
        # vllm:inter_token_latency_seconds, as its sum and count only: the router reads its mean
        # (a full histogram would cost the simulator a bucket search per token).
        self.itl_total = 0.0
        self.itl_count = 0
        # The step in flight: its start, duration, per-sequence token counts, and for a run of
        # identical decode steps their count and the terms of their durations.
        self._plan: list[tuple[Seq, int]] = []
        self._start = 0.0
        self._duration = 0.0
        self._run_steps = 1
        self._run_a = 0.0
        self._run_b = 0.0

    # --- what a scrape would read ------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """``vllm:num_requests_waiting``."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """``vllm:num_requests_running``."""
        return len(self.running)

    @property
    def kv_cache_usage_perc(self) -> float:
        """``vllm:kv_cache_usage_perc``: blocks referenced by sequences over all blocks."""
        return self.pool.usage

    @property
    def busy(self) -> bool:
        """Whether a step is in flight."""
        return bool(self._plan)

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing to do."""
        return not self._plan and not self.running and not self.waiting

    def cached_prefix_tokens(self, seq: Seq) -> int:
        """Tokens of ``seq``'s prompt this replica holds now (what a precise index would report)."""
        return min(seq.key_end(self.pool.match(seq.keys)), seq.prompt_tokens)

    def missing_blocks(self, seq: Seq, keys: int) -> int:
        """Blocks of ``seq``'s first ``keys`` prompt keys this replica does not hold: what a KV
        connector must fetch (vLLM's decode side looks up its own prefix cache first)."""
        keys = min(keys, len(seq.keys))
        held = self.pool.match(seq.keys[:keys])
        bs = self.pool.block_size
        return sum(seq.key_blocks(j, bs) for j in range(held, keys))

    def receive(self, seq: Seq, keys: int) -> int:
        """Blocks of ``seq``'s first ``keys`` prompt keys arrive from another replica (a KV
        transfer): they become cached, unreferenced entries, so admission finds them as prefix
        hits. Stops at the first that finds no room. Returns the blocks stored."""
        pool = self.pool
        bs = pool.block_size
        stored: list[int] = []
        blocks = 0
        for j, key in enumerate(seq.keys[: min(keys, len(seq.keys))]):
            if key in pool:
                continue
            size = seq.key_blocks(j, bs)
            if not pool.insert(key, size):
                break
            stored.append(key)
            blocks += size
        # Released tail first, as a finished sequence's blocks, so the head outlives the tail.
        pool.release(reversed(stored))
        return blocks

    # --- requests in and out -------------------------------------------------------------------

    def submit(self, seq: Seq, now: float) -> None:
        """A request arrives; it joins the queue and is admitted at the next step boundary.

        A request whose prompt and output could never fit in the KV cache at once is computed
        without holding blocks (vLLM would refuse it; the fake answers, so a gateway test with a
        huge body still sees a reply)."""
        bs = self.profile.block_size
        if -(-(seq.prompt_tokens + seq.output_tokens) // bs) > self.profile.num_gpu_blocks:
            seq.unbounded = True
            seq.keys = ()
        seq.state = WAITING
        seq.arrived_at = now
        self.waiting.append(seq)
        self.prompt_tokens_total += seq.prompt_tokens

    def abort(self, seq: Seq, now: float) -> None:
        """The client went away: free the sequence's blocks and forget it."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state == RUNNING:
            self.running.remove(seq)
            self._free(seq)
        else:
            return
        seq.state = ABORTED
        seq.finished_at = now
        self.finished["abort"] += 1

    def _free(self, seq: Seq) -> None:
        pool = self.pool
        if seq.held:
            pool.release(seq.keys[seq.held - 1 :: -1])
        pool.grow_private(-seq.private)
        seq.held = 0
        seq.private = 0

    def _preempt(self, seq: Seq) -> None:
        """Recompute-mode preemption: drop everything computed, back to the head of the queue."""
        self.running.remove(seq)
        self._free(seq)
        seq.state = WAITING
        seq.computed = 0
        seq.prefilling = True
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # --- blocks ------------------------------------------------------------------------------

    def _grow(self, seq: Seq, n: int) -> bool:
        """Give ``seq`` the blocks for ``n`` more computed tokens; False (nothing changed) if there
        is no room. Full blocks become cached entries as soon as they are scheduled, so a
        request admitted later can hit them, as in vLLM."""
        if seq.unbounded:
            return True
        target = seq.computed + n
        keys = seq.keys
        nkeys = len(keys)
        i = seq.held
        while i < nkeys and seq.key_end(i + 1) <= target:
            i += 1
        pool = self.pool
        bs = pool.block_size
        private = -(-(target - seq.key_end(i)) // bs)
        new_blocks = 0
        reuse_free = 0
        for j in range(seq.held, i):
            size = pool.size_of(keys[j])
            if size:
                # Computed meanwhile by another sequence: reference it rather than duplicate it.
                if pool.is_free(keys[j]):
                    reuse_free += size
            else:
                new_blocks += seq.key_blocks(j, bs)
        extra_private = private - seq.private
        need = new_blocks + max(0, extra_private)
        if need > pool.available_blocks - reuse_free:
            return False
        if extra_private < 0:
            pool.grow_private(extra_private)
        for j in range(seq.held, i):
            key = keys[j]
            if key in pool:
                pool.acquire(key)
            else:
                pool.insert(key, seq.key_blocks(j, bs))
        if extra_private > 0:
            pool.grow_private(extra_private)
        seq.held = i
        seq.private = private
        return True

    # --- scheduling --------------------------------------------------------------------------

    def _load_offloaded(self, seq: Seq, held: int) -> None:
        """Blocks after the GPU's ``held`` that CPU memory holds are loaded back into the GPU pool
        (cached, unreferenced: admission then finds them), as the offloading connector loads them;
        stops at the first that finds no room."""
        tier = self.pool.offload
        if tier is None or seq.unbounded:
            return
        run = tier.run(seq.keys, held)
        if run:
            # What the GPU holds of the prefix is in use while the rest is loaded: never evicted for it.
            head = seq.keys[:held]
            for key in head:
                self.pool.acquire(key)
            self.receive(seq, held + run)
            self.pool.release(reversed(head))

    def _admit(self, seq: Seq, budget: int, batch_empty: bool) -> int:
        """Try to admit the head of the queue; returns its tokens this step, or -1."""
        pool = self.pool
        local = matched = self._hittable(seq, pool.match(seq.keys))
        if pool.offload is not None:
            self._load_offloaded(seq, matched)
            matched = self._hittable(seq, pool.match(seq.keys))
        hit = seq.key_end(matched)
        remaining = seq.prompt_tokens + seq.generated - hit
        if self.profile.chunked_prefill:
            n = min(remaining, budget)
            if n <= 0 and remaining > 0:
                return -1
        else:
            if remaining > budget and not batch_empty:
                return -1
            n = remaining
        for key in seq.keys[:matched]:
            pool.acquire(key)
        seq.held = matched
        seq.computed = hit
        if not self._grow(seq, n):
            pool.release(seq.keys[matched - 1 :: -1] if matched else ())
            seq.held = 0
            seq.computed = 0
            return -1
        prompt_hit = min(hit, seq.prompt_tokens)
        self.prefix_queries_tokens += seq.prompt_tokens
        # The GPU pool's own hits; what was loaded from CPU memory is a connector's hit, reported
        # in the request's cached tokens only (as vLLM does).
        self.prefix_hits_tokens += min(seq.key_end(local), seq.prompt_tokens)
        if seq.cached_tokens < 0:
            seq.cached_tokens = prompt_hit
            self.cached_prompt_tokens_total += prompt_hit
        return n

    @staticmethod
    def _hittable(seq: Seq, matched: int) -> int:
        """Of ``matched`` cached keys, those a request can use: vLLM computes at least the last
        token it has (its logits are needed), so a hit ends before it, in whole keys."""
        last = seq.prompt_tokens + seq.generated - 1
        while matched and seq.key_end(matched) > last:
            matched -= 1
        return matched

    def _schedule(self) -> tuple[list[tuple[Seq, int]], bool]:
        """Choose this step's work; also says whether the queue was left waiting for room (so
        that identical decode steps may follow until something finishes)."""
        profile = self.profile
        budget = profile.max_num_batched_tokens
        plan: list[tuple[Seq, int]] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            remaining = seq.prompt_tokens + seq.generated - seq.computed
            n = min(remaining, budget) if seq.prefilling else 1
            while not self._grow(seq, n):
                victim = running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state != RUNNING:
                break  # it preempted itself: nothing after it in the list remains
            plan.append((seq, n))
            budget -= n
            i += 1
        blocked = bool(self.waiting)
        if not preempted:
            waiting = self.waiting
            while waiting and len(running) < profile.max_running and (budget > 0 or not plan):
                seq = waiting[0]
                n = self._admit(seq, budget, not plan)
                if n < 0:
                    break
                waiting.popleft()
                seq.state = RUNNING
                seq.prefilling = True
                running.append(seq)
                plan.append((seq, n))
                budget -= n
            blocked = bool(waiting)
        return plan, blocked and not preempted

    def begin_step(self, now: float, max_steps: int = 1) -> float | None:
        """Plan the next step starting at ``now``; returns its duration, or None if there is
        nothing to do. With ``max_steps > 1`` a step of pure decode is extended into a run of up
        to that many identical steps, ending at the latest when a sequence finishes or blocks
        run short (the simulator's fast path; :meth:`cut` ends a run early)."""
        if self._plan:
            raise RuntimeError("a step is already in flight")
        if not self.running and not self.waiting:
            return None
        plan, blocked = self._schedule()
        if not plan:
            return None
        profile = self.profile
        prefill_tokens = 0
        pairs = 0.0
        has_prefill = False
        seqs = 0
        kv_tokens = 0
        for seq, n in plan:
            if seq.prefilling:
                has_prefill = True
                prefill_tokens += n
                pairs += n * (seq.computed + n / 2)
            else:
                seqs += 1
                kv_tokens += seq.computed + 1
        duration = profile.step_seconds(prefill_tokens, pairs, has_prefill, seqs, kv_tokens)
        steps = 1
        if max_steps > 1 and not has_prefill and (blocked or not self.waiting):
            steps = self._run_length(plan, max_steps)
            if steps > 1:
                # Step j (from 0) reads j more tokens of context per sequence than the first.
                self._run_a = duration
                self._run_b = profile.decode_s_per_kv_token * seqs
                duration = steps * duration + self._run_b * steps * (steps - 1) / 2
        self._plan = plan
        self._start = now
        self._duration = duration
        self._run_steps = steps
        return duration

    def _run_length(self, plan: list[tuple[Seq, int]], max_steps: int) -> int:
        """How many identical decode steps can follow from this one: until the first sequence
        finishes or fills a block its keys name (it becomes cached then), and no further than the
        free blocks allow."""
        steps = max_steps
        for seq, _ in plan:
            steps = min(steps, seq.output_tokens - seq.generated)
            if seq.held < len(seq.keys):  # an output key ahead: the run stops where its block fills
                steps = min(steps, seq.key_end(seq.held + 1) - seq.computed)
        if steps <= 1:
            return 1
        bs = self.pool.block_size
        available = self.pool.available_blocks
        offsets = [seq.computed - seq.key_end(seq.held) for seq, _ in plan]

        def extra(k: int) -> int:
            # Blocks needed by steps 2..k beyond what the first step already holds.
            return sum(-(-(u + k) // bs) - -(-(u + 1) // bs) for u in offsets)

        if extra(steps) <= available:
            return steps
        lo, hi = 1, steps  # extra(lo) fits, extra(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra(mid) <= available:
                lo = mid
            else:
                hi = mid
        return lo

    @property
    def step_end(self) -> float:
        """When the step (or run) in flight ends."""
        return self._start + self._duration

    def cut(self, now: float) -> float:
        """End a run of decode steps at the first step boundary at or after ``now`` (a request
        arrived and must join the next step); returns the new end. A single step is never cut."""
        if self._run_steps <= 1 or now >= self.step_end:
            return self.step_end
        elapsed = max(0.0, now - self._start)
        a, b = self._run_a, self._run_b
        # Smallest j with a*j + b*j*(j-1)/2 >= elapsed (j >= 1).
        if b > 0:
            half = b / 2
            j = math.ceil((-(a - half) + math.sqrt((a - half) ** 2 + 4 * half * elapsed)) / (2 * half))
        else:
            j = math.ceil(elapsed / a) if a > 0 else 1
        j = max(1, min(self._run_steps, j))
        while j > 1 and a * (j - 1) + b * (j - 1) * (j - 2) / 2 >= elapsed:
            j -= 1
        while j < self._run_steps and a * j + b * j * (j - 1) / 2 < elapsed:
            j += 1
        self._run_steps = j
        self._duration = a * j + b * j * (j - 1) / 2
        return self.step_end

    def end_step(self) -> StepResult:
        """Commit the step (or run) in flight at its end: tokens emitted, first tokens, finishes."""
        plan = self._plan
        if not plan:
            raise RuntimeError("no step in flight")
        end = self._start + self._duration
        steps = self._run_steps
        self._plan = []
        self._run_steps = 1
        self.busy_s += self._duration
        self.steps += steps
        emitted: list[Seq] = []
        first: list[Seq] = []
        finished: list[Seq] = []
        pool = self.pool
        bs = pool.block_size
        tokens = 0
        for seq, n in plan:
            if seq.state != RUNNING:
                continue  # aborted during the step
            tokens += n * steps
            if steps > 1:
                # A run: the first step's blocks were taken when it was planned, the rest now
                # (room for them was checked when the run was planned).
                seq.computed += steps
                seq.generated += steps
                private = -(-(seq.computed - seq.key_end(seq.held)) // bs)
                pool.grow_private(private - seq.private)
                seq.private = private
                self.generation_tokens_total += steps
                self.itl_total += end - seq.last_token_at
                self.itl_count += steps
                seq.last_token_at = end
                emitted.append(seq)
            else:
                seq.computed += n
                if seq.prefilling:
                    seq.prefill_tokens += n
                    self.prefill_tokens_computed += n
                if seq.computed < seq.prompt_tokens + seq.generated:
                    continue  # a chunk of a longer prompt: no token yet
                seq.prefilling = False
                seq.generated += 1
                self.generation_tokens_total += 1
                emitted.append(seq)
                if seq.generated == 1:
                    seq.first_token_at = end
                    self.ttft.observe(end - seq.arrived_at)
                    first.append(seq)
                else:
                    self.itl_total += end - seq.last_token_at
                    self.itl_count += 1
                seq.last_token_at = end
            if seq.generated >= seq.output_tokens:
                finished.append(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                self._free(seq)
                seq.state = DONE
                seq.finished_at = end
                self.e2e.observe(end - seq.arrived_at)
                self.finished[seq.finish_reason] += 1
        return StepResult(end, steps, emitted, first, finished, tokens)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence uses (the counters keep their totals), and what CPU
        memory holds (a whole reset's ``AllBlocksCleared`` covers every tier)."""
        in_use = self.pool.referenced  # then the pool tells its evictions one by one, not a reset
        self.pool.reset()
        if self.pool.offload is not None:
            self.pool.offload.clear(announce=in_use)
