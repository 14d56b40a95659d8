"""The conversations each replica carries: sessions with a turn in flight there, or whose last
turn there began recently enough that the next one is still to come.

A new session placed only by what a replica holds and has queued now does not see the decode load
already pinned there: the streams of its conversations running, and their next turns, which come
back to it whatever else happens. Counted here per replica, it is part of the load picture
(:attr:`~extproc.routing.model.ReplicaState.live_sessions`), so a prefix every conversation shares
does not draw all new conversations onto the few replicas that prefilled it first.

Each session also carries the KV of its own it added where it lives, counted from the moment it
is placed, so that a burst of new conversations sees the ones placed just before it. A
conversation its client declared (a session key) counts in full at once; a keyless request that
opens a conversation may be a one-off (a hot system prompt's single questions, which leave nothing
to come), so its KV counts at the rate at which recent keyless openings came back for a second
turn, and in full once it comes back itself; while its first turn runs, at least at
:data:`OPENING_WEIGHT` (a first wave of conversations opening together, before any has come
back, then sees the ones placed before it, and a one-off weighs only that little while it runs).

Bounded and cheap: one entry per session live within ``live_s``, oldest first; a decision or an end
is O(1), a snapshot drops what expired since the last one and reads one sum per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Session:
    replica: str
    last_begin: float
    inflight: int = 0
    tokens: int = 0
    """The KV of its own it added there: its turns' prompt tokens not believed cached when sent."""
    firm: bool = True
    """Its KV is counted in full: its client declared a conversation (a session key), it came back
    for a second turn, or its agent said it keeps its KV across a tool call. Otherwise it is a
    keyless request that opened a conversation and has not come back: it may be a one-off, and
    its KV counts at the rate such openings have been coming back (:meth:`LiveSessions.return_rate`),
    at least at :data:`OPENING_WEIGHT` while its first turn runs."""
    held_until: float = 0.0
    """An agent's KV retention: live at least until then, whatever ``live_s`` says."""


MAX_HOLD_S = 3600.0
"""The longest retention honoured (Anthropic's longest cache ttl, an hour)."""

RETURN_MEMORY = 64.0
"""How many of the latest keyless openings (come back or lapsed) the return rate remembers, each
older one weighing ``1 - 1/RETURN_MEMORY`` of the one after it: enough not to swing on a few, few
enough to follow a change of traffic within a minute or so of it."""

OPENING_WEIGHT = 0.25
"""What a keyless opening's KV counts at, at least, while its first turn runs (its rate before
any opening has come back, which is 0). Eight keyless conversations opening together with a
shared system prompt, counted at the rate alone, all followed the prompt's holder (through real
Envoy: 84, 12, 0, 96 requests on four replicas; in the simulator 6, 84, 6, 96); from a quarter
up they spread evenly in the simulator. Counted in full while they run, a shared prefix's single
requests, which never come back, were split from their group's replica (simulator shared-prefix:
-1.7 points of hit ratio over seven router seeds); at a quarter, -0.3 point, TTFT p99 within
the seeds' spread (``benchmarks/keyless_opening_weight.py``, benchmarks/keyless_conversations.md)."""


class LiveSessions:
    """Per replica, the sessions live there (a turn in flight, or one begun within ``live_s``), and
    the KV of their own they hold there."""

    def __init__(self, live_s: float = 60.0, max_sessions: int = 200_000) -> None:
        self.live_s = live_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._firm: dict[str, int] = {}
        self._provisional: dict[str, int] = {}
        self._opening: dict[str, int] = {}
        """The part of ``_provisional`` whose first turn is still running (counted at least at
        :data:`OPENING_WEIGHT`)."""
        self._provisional_n: dict[str, int] = {}
        self._opening_n: dict[str, int] = {}
        """As ``_provisional`` and ``_opening``, in conversations rather than tokens."""
        self._returned = 0.0
        self._lapsed = 0.0
        self.opening_weight = OPENING_WEIGHT
        """What a keyless opening counts at, at least, while its first turn runs."""

    def __len__(self) -> int:
        return len(self._sessions)

    def begin(
        self,
        replica: str,
        session: str,
        now: float,
        hold_s: float | None = None,
        tokens: int = 0,
        declared: bool = True,
    ) -> None:
        """A turn of ``session`` was sent to ``replica`` at ``now`` (``hold_s``: the agent keeps its
        KV that long across its tool call: live at least until then), adding ``tokens`` of KV of
        its own there (the part of its prompt not believed cached). ``declared``: the request
        says it belongs to a conversation (a session key, or messages continuing one); False for
        a keyless request opening one, which may never come back."""
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session(replica, now, firm=declared or hold_s is not None)
            self._count(s)
            if len(self._sessions) > self.max_sessions:
                self._drop(next(iter(self._sessions)))
        else:
            if s.replica != replica:
                self._uncount(s)
                s.replica = replica
                s.tokens = 0  # what it held on the replica it left is not carried here
                self._count(s)
            if not s.firm:
                self._note(returned=True)
                self._firm_up(s)
        if hold_s is not None and not s.firm:
            self._firm_up(s)
        added = max(0, tokens)
        s.tokens += added
        if added:
            held = self._firm if s.firm else self._provisional
            held[replica] = held.get(replica, 0) + added
            if not s.firm:  # its first turn is starting: at least at OPENING_WEIGHT while it runs
                self._opening[replica] = self._opening.get(replica, 0) + added
        s.last_begin = now
        if not s.firm and s.inflight == 0:
            self._opening_n[replica] = self._opening_n.get(replica, 0) + 1
        s.inflight += 1
        if hold_s is not None:
            s.held_until = max(s.held_until, now + min(hold_s, MAX_HOLD_S))
        self._sessions.move_to_end(session)

    def end(self, session: str) -> None:
        """A turn of ``session`` is over (it stays live until ``live_s`` after it began)."""
        s = self._sessions.get(session)
        if s is not None and s.inflight > 0:
            s.inflight -= 1
            if not s.firm and s.inflight == 0:  # an opening's first turn is over: at the rate now
                _take(self._opening, s.replica, s.tokens)
                _take(self._opening_n, s.replica, 1)

    def counts(self, now: float) -> dict[str, int]:
        """Live sessions per replica at ``now`` (replicas without any are left out)."""
        horizon = now - self.live_s
        while self._sessions:
            key, s = next(iter(self._sessions.items()))
            if s.last_begin >= horizon:
                break
            if s.inflight > 0:
                # Still streaming: live until its turn ends, checked again a window later.
                s.last_begin = now
                self._sessions.move_to_end(key)
                continue
            if s.held_until > now:
                # Held for its agent's tool call: checked again when the hold ends (or a window
                # later, if sooner).
                s.last_begin = now - self.live_s + min(self.live_s, s.held_until - now)
                self._sessions.move_to_end(key)
                continue
            self._drop(key)
        return self._counts

    def return_rate(self) -> float:
        """The share of recent keyless openings that came back for a second turn (0 until one
        has): what a keyless opening's KV is counted at until it comes back itself."""
        return self._returned / (self._returned + self._lapsed) if self._returned else 0.0

    def expected(self, now: float) -> dict[str, float]:
        """Per replica, the conversations live there that are expected to come back: each declared
        one or one that came back in full, a keyless opening at :meth:`return_rate` (at least at
        :data:`OPENING_WEIGHT` while its first turn runs), as :meth:`tokens` counts their KV; a hot
        prefix's single questions, which never come back, weigh only that little while they run."""
        counts = self.counts(now)
        rate = self.return_rate()
        out: dict[str, float] = {}
        for replica, n in counts.items():
            provisional = self._provisional_n.get(replica, 0)
            running = self._opening_n.get(replica, 0)
            out[replica] = n - provisional + running * max(rate, self.opening_weight) + (provisional - running) * rate
        return out

    def tokens(self, now: float) -> dict[str, int]:
        """Per replica, the KV of their own that the sessions live there at ``now`` added: in full
        for declared conversations and those that came back, at :meth:`return_rate` for keyless
        openings that have not (at least at :data:`OPENING_WEIGHT` while their first turn runs;
        replicas without any are left out). O(replicas)."""
        self.counts(now)
        rate = self.return_rate()
        held = dict(self._firm)
        for replica, provisional in self._provisional.items():
            running = self._opening.get(replica, 0)
            counted = running * max(rate, self.opening_weight) + (provisional - running) * rate
            held[replica] = held.get(replica, 0) + round(counted)
        return {replica: tokens for replica, tokens in held.items() if tokens > 0}

    def forget(self, replica: str) -> None:
        """A replica left: its sessions are no longer counted anywhere."""
        for key in [k for k, s in self._sessions.items() if s.replica == replica]:
            self._sessions.pop(key)
        self._counts.pop(replica, None)
        self._firm.pop(replica, None)
        self._provisional.pop(replica, None)
        self._opening.pop(replica, None)
        self._provisional_n.pop(replica, None)
        self._opening_n.pop(replica, None)

    def _note(self, returned: bool) -> None:
        """A keyless opening came back (or lapsed): the evidence the return rate is made of."""
        keep = 1.0 - 1.0 / RETURN_MEMORY
        self._returned *= keep
        self._lapsed *= keep
        if returned:
            self._returned += 1.0
        else:
            self._lapsed += 1.0

    def _firm_up(self, s: _Session) -> None:
        """Count ``s``'s KV in full from now on."""
        _take(self._provisional, s.replica, s.tokens)
        _take(self._provisional_n, s.replica, 1)
        if s.inflight:
            _take(self._opening, s.replica, s.tokens)
            _take(self._opening_n, s.replica, 1)
        if s.tokens:
            self._firm[s.replica] = self._firm.get(s.replica, 0) + s.tokens
        s.firm = True

    def _drop(self, key: str) -> None:
        s = self._sessions.pop(key)
        if not s.firm:
            self._note(returned=False)  # it never came back within the window: a one-off
        self._uncount(s)

    def _count(self, s: _Session) -> None:
        """Count ``s`` on its replica (its KV is added by its turns, as they are sent)."""
        self._counts[s.replica] = self._counts.get(s.replica, 0) + 1
        if not s.firm:
            self._provisional_n[s.replica] = self._provisional_n.get(s.replica, 0) + 1
            if s.inflight:
                self._opening_n[s.replica] = self._opening_n.get(s.replica, 0) + 1

    def _uncount(self, s: _Session) -> None:
        _take(self._counts, s.replica, 1)
        _take(self._firm if s.firm else self._provisional, s.replica, s.tokens)
        if not s.firm:
            _take(self._provisional_n, s.replica, 1)
            if s.inflight:
                _take(self._opening, s.replica, s.tokens)
                _take(self._opening_n, s.replica, 1)


def _take(counts: dict[str, int], replica: str, amount: int) -> None:
    """Take ``amount`` off ``replica``'s count, leaving it out once nothing is left."""
    left = counts.get(replica, 0) - amount
    if left > 0:
        counts[replica] = left
    else:
        counts.pop(replica, None)
