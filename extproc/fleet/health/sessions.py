"""The conversations each replica carries: sessions with a turn in flight there, or whose last
turn there began recently enough that the next one is still to come.

A new session placed only by what a replica holds and has queued now does not see the decode load
already pinned there: the streams of its conversations running, and their next turns, which come
back to it whatever else happens. Counted here per replica, it is part of the load picture
(:attr:`~extproc.routing.model.ReplicaState.live_sessions`), so a prefix every conversation shares
does not draw all new conversations onto the few replicas that prefilled it first.

Bounded and cheap: one entry per session live within ``live_s``, oldest first; a decision or an end
is O(1), a snapshot drops what expired since the last one.
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
    returning: bool = False
    """It came back for a second turn (or its agent said it keeps its KV across a tool call): only
    then is its KV counted as load to come, since a one-off request leaves nothing to come."""
    held_until: float = 0.0
    """An agent's KV retention: live at least until then, whatever ``live_s`` says."""


MAX_HOLD_S = 3600.0
"""The longest retention honoured (Anthropic's longest cache ttl, an hour)."""


class LiveSessions:
    """Per replica, the sessions live there (a turn in flight, or one begun within ``live_s``)."""

    def __init__(self, live_s: float = 60.0, max_sessions: int = 200_000) -> None:
        self.live_s = live_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def begin(self, replica: str, session: str, now: float, hold_s: float | None = None, tokens: int = 0) -> None:
        """A turn of ``session`` was sent to ``replica`` at ``now`` (``hold_s``: the agent keeps its
        KV that long across its tool call: live at least until then), adding ``tokens`` of KV of
        its own there (the part of its prompt not believed cached)."""
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session(replica, now)
            self._counts[replica] = self._counts.get(replica, 0) + 1
            if len(self._sessions) > self.max_sessions:
                self._drop(next(iter(self._sessions)))
        else:
            if s.replica != replica:
                self._uncount(s)
                self._counts[replica] = self._counts.get(replica, 0) + 1
                s.replica = replica
                s.tokens = 0  # what it held on the replica it left is not carried here
            elif not s.returning:
                self._tokens[replica] = self._tokens.get(replica, 0) + s.tokens  # its first turn's KV
            s.returning = True
        if hold_s is not None and not s.returning:
            s.returning = True
            self._tokens[replica] = self._tokens.get(replica, 0) + s.tokens
        s.tokens += max(0, tokens)
        if s.returning and tokens > 0:
            self._tokens[replica] = self._tokens.get(replica, 0) + tokens
        s.last_begin = now
        s.inflight += 1
        if hold_s is not None:
            s.held_until = max(s.held_until, now + min(hold_s, MAX_HOLD_S))
        self._sessions.move_to_end(session)

    def end(self, session: str) -> None:
        """A turn of ``session`` is over (it stays live until ``live_s`` after it began)."""
        s = self._sessions.get(session)
        if s is not None and s.inflight > 0:
            s.inflight -= 1

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

    def tokens(self, now: float) -> dict[str, int]:
        """Per replica, the KV of their own that the sessions live there at ``now`` and returning
        (a second turn begun, or a KV retention asked) added (replicas without any are left out)."""
        self.counts(now)
        return self._tokens

    def forget(self, replica: str) -> None:
        """A replica left: its sessions are no longer counted anywhere."""
        for key in [k for k, s in self._sessions.items() if s.replica == replica]:
            self._drop(key)
        self._counts.pop(replica, None)
        self._tokens.pop(replica, None)

    def _drop(self, key: str) -> None:
        self._uncount(self._sessions.pop(key))

    def _uncount(self, s: _Session) -> None:
        replica = s.replica
        left = self._counts.get(replica, 0) - 1
        if left > 0:
            self._counts[replica] = left
        else:
            self._counts.pop(replica, None)
        held = self._tokens.get(replica, 0) - (s.tokens if s.returning else 0)
        if held > 0:
            self._tokens[replica] = held
        else:
            self._tokens.pop(replica, None)
