"""KV room: a request decided on a replica waits at the gateway until that replica's KV has room
for it, and the room a conversation's turn used is kept a moment for its next turn.

An engine whose running requests fill its KV cache queues the rest itself, first come first
served, and every prefill it then makes evicts the least recently used cached blocks. A
conversation's history, freed when its turn ends, is gone before its next turn, queued behind
the others, is run (benchmarks/realstack-vllm.md: under 1,500 tokens prefilled beside it a
follow-up finds 70-88% of its prompt, past 3,000 only the system prompt).

:class:`KvRoom` keeps what the router sends a replica within the replica's KV (the prompts and
expected outputs of its requests in flight, in tokens, a prompt block several of them hold counted
once, as the engine holds it; ``queueing.kv_room_share`` of the cache) and holds the rest here,
first come first served. When a request of a conversation (a session key) ends, the room it used
is kept for that conversation: its next turn, sent at once by an agent or a script, goes ahead of
what waits (first in line should its history have grown past the room kept) and runs while its
history is still cached. The room is kept a few times the conversation's own last gap between
turns (``grace_s`` at most, all of it until a gap is known; at least as long as most next turns
sent at once take to come), and not at all for a conversation whose last gap was longer; a turn
that came is waited for while the router decides it (:meth:`KvRoom.arrived`). What has waited
``patience_s`` goes before kept room (the time to first token of new conversations is bounded by
it, at the price of the histories it evicts), and what has waited ``max_wait_s`` goes anyway:
the engine's own queue is the worst it gets.

A new conversation (no replica holds its history) is decided among the replicas with room for
it; with none, it waits for whichever of them frees room first (:meth:`KvRoom.enter_any`, in the
order it came among the requests decided on that replica) and is decided there, not on the
replica it would have been decided on at once: which engine finishes first is not known when it
arrives.

The room is counted per router process, from the requests it sent: each of ``serve --workers N``
claims 1/N of a replica's KV, and several gateways in front of one engine should divide it with
``kv_room_share``.

:class:`KvRoom` is the decisions, without IO (an injected clock);
:class:`~extproc.fleet.queueing.room_gate.RoomGate` drives it on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

GAP_FLOOR_S = 0.05
"""The least room is kept for a conversation: its next turn's way through Envoy and the router."""
GAP_TIMES = 4.0
"""Room is kept this many times the conversation's last gap between turns."""
TURNAROUNDS_KEPT = 256
"""The last gaps between turns (of conversations without think time) the floor is read from."""
TURNAROUND_QUANTILE = 0.95
"""Room is kept at least this quantile of those gaps: how late a next turn sent at once comes."""
SESSIONS_KEPT = 100_000
"""Conversations whose last end (and gap) is remembered, the oldest forgotten first."""


@dataclass(eq=False, slots=True)
class Entry:
    """One request's claim on a replica's KV: ``tokens`` (its prompt and expected output), the
    first of which are ``blocks`` (its prompt's block keys) of ``block_tokens`` each; a block
    another request there holds too is counted once, as the engine holds it once."""

    replica: str
    session: str | None
    tokens: int
    since: float
    blocks: tuple[int, ...] = ()
    block_tokens: int = 0
    inside: bool = False
    """It went (and holds its room until :meth:`KvRoom.leave`)."""
    granted: asyncio.Future[None] | None = None
    ahead: bool = False
    """A conversation's next turn grown past the room kept for it: first in line all the same."""
    among: frozenset[str] = frozenset()
    """A new conversation waiting for room on any of these replicas (``replica`` empty until it
    is given one: :meth:`KvRoom.enter_any`)."""


@dataclass(slots=True)
class _Replica:
    name: str
    capacity: int = 0
    own: int = 0
    """The tokens of the requests inside beyond their blocks (their prompts' tails, their outputs)."""
    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Each block a request inside holds: (requests holding it, its tokens)."""
    block_total: int = 0
    inside: int = 0
    waiting: deque[Entry] = field(default_factory=deque)
    kept: dict[str, tuple[int, float]] = field(default_factory=dict)
    """session -> (tokens kept for its next turn, until when)."""

    def kept_for_others(self, session: str | None, now: float) -> int:
        return sum(tokens for s, (tokens, until) in self.kept.items() if s != session and until > now)

    @property
    def used(self) -> int:
        return self.block_total + self.own

    def claim(self, entry: Entry) -> int:
        """The tokens ``entry`` would add here: what of it no request inside holds."""
        blocks = self.blocks
        shared = sum(1 for b in entry.blocks if b in blocks)
        return entry.tokens - shared * entry.block_tokens

    def add(self, entry: Entry) -> None:
        for b in entry.blocks:
            held, tokens = self.blocks.get(b, (0, entry.block_tokens))
            if not held:
                self.block_total += tokens
            self.blocks[b] = (held + 1, tokens)
        self.own += entry.tokens - len(entry.blocks) * entry.block_tokens
        self.inside += 1

    def remove(self, entry: Entry) -> None:
        for b in entry.blocks:
            held, tokens = self.blocks[b]
            if held == 1:
                del self.blocks[b]
                self.block_total -= tokens
            else:
                self.blocks[b] = (held - 1, tokens)
        self.own -= entry.tokens - len(entry.blocks) * entry.block_tokens
        self.inside -= 1


class KvRoom:
    """Per replica: the KV the router's requests in flight there claim, the requests waiting for
    room, and the room kept for conversations between turns."""

    def __init__(self, clock: Callable[[], float], grace_s: float, patience_s: float) -> None:
        self.clock = clock
        self.grace_s = grace_s
        self.patience_s = patience_s
        self._replicas: dict[str, _Replica] = {}
        self._unbound: deque[Entry] = deque()
        """New conversations waiting for room on whichever of their replicas frees it first."""
        self._ended: dict[str, float] = {}
        """session -> when its last turn ended."""
        self._gaps: dict[str, float] = {}
        """session -> its last gap between a turn's end and its next turn's arrival."""
        self._turnarounds: deque[float] = deque(maxlen=TURNAROUNDS_KEPT)
        self.floor_s = GAP_FLOOR_S
        """The least room is kept for: the gaps of next turns sent at once vary with the client, the
        proxy and a loaded gateway (one of 10 ms, the same conversation's next of 90 ms, measured on
        a loaded machine), and one that comes after its room lapsed waits behind newcomers."""

    def waiting(self) -> int:
        """Requests waiting for room, over every replica."""
        return len(self._unbound) + sum(len(r.waiting) for r in self._replicas.values())

    def would_wait(self, entry: Entry, replica: str, capacity: int) -> bool:
        """Whether ``entry``, a new conversation, would wait for room on ``replica`` (of
        ``capacity`` KV tokens, 0 unknown) were it sent there now."""
        r = self._replica(replica, capacity)
        return self._queued(r) or not self._fits(r, entry, self.clock())

    def enter_any(self, entry: Entry) -> bool:
        """A new conversation every replica it may go to (``entry.among``) is full for: True when
        one of them has room for it now (``entry.replica`` names it); else it waits, first come
        first served, for whichever frees room first (:meth:`leave`, :meth:`expire_kept`)."""
        now = self.clock()
        if entry.session is not None:  # a conversation its replica lost: what was kept there is no use
            self._arrived(entry.session, now)
            for kept_on in self._replicas.values():
                kept_on.kept.pop(entry.session, None)
        for name in sorted(entry.among):
            r = self._replicas.get(name)
            if r is not None and not self._queued(r) and self._fits(r, entry, now):
                self._take(r, entry)
                return True
        self._unbound.append(entry)
        return False

    def enter(self, entry: Entry, capacity: int) -> bool:
        """A request decided on ``entry.replica`` (whose KV is ``capacity`` tokens, 0 unknown):
        True when it goes now; else it waits, until :meth:`leave` or :meth:`expire_kept` returns
        it (or :meth:`force`)."""
        now = self.clock()
        r = self._replica(entry.replica, capacity)
        own = False
        if entry.session is not None:
            own = r.kept.pop(entry.session, None) is not None
            self._arrived(entry.session, now)
        if own and (first := self._next(r)) is not None and now - first.since >= self.patience_s:
            own = False  # what waits has waited long enough: it goes first
        if (own or not self._queued(r)) and self._fits(r, entry, now):
            self._take(r, entry)
            return True
        if own:
            entry.ahead = True  # its history grew past its kept room: it is next, all the same
            r.waiting.appendleft(entry)
        else:
            r.waiting.append(entry)
        return False

    def leave(self, entry: Entry, keep: bool = True) -> list[Entry]:
        """A request that went is over: its room is freed, and (``keep``) kept a moment for its
        conversation; the waiters that go now."""
        if not entry.inside:
            return []
        entry.inside = False
        r = self._replicas[entry.replica]
        r.remove(entry)
        now = self.clock()
        if keep and entry.session is not None:
            _remember(self._ended, entry.session, now)
            if (moment := self.kept_for(entry.session)) > 0:
                kept = r.claim(entry)  # what its next turn will hold again beside the others
                r.kept[entry.session] = (kept, now + moment)
        return self._release(r, now)

    def arrived(self, session: str) -> list[str]:
        """A turn of ``session`` came to the router, before it is decided: its gap since its last
        turn ended is measured from here, and room kept for it is kept ``grace_s`` more for it to
        be decided in (the router's own time, longer on a loaded gateway, is not the
        conversation's gap); the replicas it is kept on."""
        now = self.clock()
        self._arrived(session, now)
        out = []
        for r in self._replicas.values():
            kept = r.kept.get(session)
            if kept is not None and kept[1] > now:
                r.kept[session] = (kept[0], max(kept[1], now + self.grace_s))
                out.append(r.name)
        return out

    def _arrived(self, session: str, now: float) -> None:
        """A turn of ``session`` came: the gap since its last one ended is remembered."""
        if (ended := self._ended.pop(session, None)) is not None:
            gap = now - ended
            _remember(self._gaps, session, gap)
            if gap <= self.grace_s:
                self._turnarounds.append(gap)
                ordered = sorted(self._turnarounds)
                self.floor_s = max(GAP_FLOOR_S, ordered[int(TURNAROUND_QUANTILE * (len(ordered) - 1))])

    def kept_for(self, session: str) -> float:
        """How long room is kept for ``session``'s next turn: none where its last gap was longer
        than ``grace_s`` (it would only idle the room)."""
        gap = self._gaps.get(session)
        if gap is None:
            return self.grace_s
        return 0.0 if gap > self.grace_s else min(self.grace_s, max(self.floor_s, GAP_TIMES * gap))

    def abandon(self, entry: Entry) -> list[Entry]:
        """A waiter gave up (its client went away, or its time is up); the waiters that go now."""
        if entry.inside:
            return []
        now = self.clock()
        if not entry.replica:
            with contextlib.suppress(ValueError):
                self._unbound.remove(entry)
            # It may have stood first in line for a replica with room for those behind it.
            return [e for name in sorted(entry.among) if (r := self._replicas.get(name)) for e in self._release(r, now)]
        r = self._replicas.get(entry.replica)
        if r is None:
            return []
        with contextlib.suppress(ValueError):
            r.waiting.remove(entry)
        return self._release(r, now)

    def force(self, entry: Entry) -> None:
        """A waiter held ``max_wait_s`` goes anyway (the engine queues it)."""
        r = self._replicas[entry.replica]
        with contextlib.suppress(ValueError):
            r.waiting.remove(entry)
        if not entry.inside:
            self._take(r, entry)

    def expire_kept(self, replica: str) -> list[Entry]:
        """Room kept past its moment is free again; the waiters that go now."""
        r = self._replicas.get(replica)
        if r is None:
            return []
        now = self.clock()
        r.kept = {s: kept for s, kept in r.kept.items() if kept[1] > now}
        return self._release(r, now)

    def _fits(self, r: _Replica, entry: Entry, now: float) -> bool:
        kept = 0 if now - entry.since >= self.patience_s else r.kept_for_others(entry.session, now)
        if r.inside == 0 and kept == 0:
            return True  # an idle replica takes anything: a request larger than its KV still runs
        return r.capacity <= 0 or r.used + kept + r.claim(entry) <= r.capacity

    def _replica(self, name: str, capacity: int) -> _Replica:
        r = self._replicas.get(name)
        if r is None:
            r = self._replicas[name] = _Replica(name)
        if capacity > 0:
            r.capacity = capacity
        return r

    def _take(self, r: _Replica, entry: Entry) -> None:
        entry.inside = True
        entry.replica = r.name
        r.add(entry)

    def _first_unbound(self, r: _Replica) -> Entry | None:
        """The longest waiting new conversation that may go to ``r``."""
        return next((e for e in self._unbound if r.name in e.among), None)

    def _queued(self, r: _Replica) -> bool:
        """Whether requests wait for room on ``r``: those decided on it, or new conversations."""
        return bool(r.waiting) or self._first_unbound(r) is not None

    def _next(self, r: _Replica) -> Entry | None:
        """The waiter ``r``'s room goes to first: the one that came first, of those decided on it
        and the new conversations that may go there (a next turn grown past its kept room first)."""
        head = r.waiting[0] if r.waiting else None
        new = self._first_unbound(r)
        if head is None or (new is not None and not head.ahead and new.since < head.since):
            return new
        return head

    def _release(self, r: _Replica, now: float) -> list[Entry]:
        """The waiters that go to ``r`` now, in the order :meth:`_next` gives, while they fit."""
        out = []
        while (entry := self._next(r)) is not None and self._fits(r, entry, now):
            if entry.replica:
                r.waiting.popleft()
            else:
                self._unbound.remove(entry)
            self._take(r, entry)
            out.append(entry)
        return out


def _remember(memory: dict[str, float], session: str, value: float) -> None:
    memory.pop(session, None)
    memory[session] = value
    if len(memory) > SESSIONS_KEPT:
        del memory[next(iter(memory))]  # the oldest: dicts keep insertion order
