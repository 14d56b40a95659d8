"""Which sessions to move, and where: pure functions of the ledger, the fleet and the clock.

- A replica **joins**: the sessions whose first choice on the new ring is the newcomer move to
  it: about 1/(N+1) of them, taken evenly from every other replica.
- A replica **leaves** (removed, or out of rotation): its sessions move to their next replica on
  the ring that is in rotation and under the load bound, instead of all landing wherever the
  next turn happens to go.
- A replica runs **hot** for a while: a fraction of its sessions moves to the lightest replicas.

A session moved recently is not moved again before ``session_cooldown_s``: no ping-pong.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from extproc.fleet.rebalance.ledger import LedgerEntry
from extproc.routing.model import ReplicaState
from extproc.routing.ring import HashRing


@dataclass(frozen=True, slots=True)
class Move:
    """Move one session to another replica (and pre-warm it there)."""

    session: str
    model: str
    source: str
    target: str
    path: str
    body: bytes
    reason: str
    hashes: Sequence[int] = ()
    """The session's prefix keys as last looked up: what the new replica is indexed under."""


def _movable(entry: LedgerEntry, now: float, session_cooldown_s: float) -> bool:
    return now - entry.moved_at >= session_cooldown_s


def plan_join(
    newcomer: str,
    sessions: Iterable[LedgerEntry],
    ring: HashRing,
    now: float,
    session_cooldown_s: float,
) -> list[Move]:
    """Sessions whose first choice on ``ring`` (which includes the newcomer) is the newcomer."""
    moves = []
    for entry in sessions:
        if entry.replica == newcomer or not _movable(entry, now, session_cooldown_s):
            continue
        if ring.preference(entry.session, 1) == [newcomer]:
            moves.append(
                Move(entry.session, entry.model, entry.replica, newcomer, entry.path, entry.body, "join", entry.hashes)
            )
    return moves


def plan_leave(
    leaver: str,
    sessions: Iterable[LedgerEntry],
    ring: HashRing,
    states: Sequence[ReplicaState],
    load_factor: float = 1.25,
) -> list[Move]:
    """Every session of ``leaver`` to its next ring replica in rotation, within a load bound
    counted in sessions (those already there plus those moved so far)."""
    usable = {s.name for s in states if s.in_rotation and s.name != leaver}
    if not usable:
        return []
    mine = [e for e in sessions if e.replica == leaver]
    counts: dict[str, int] = dict.fromkeys(usable, 0)
    for s in states:
        if s.name in counts:
            counts[s.name] = s.inflight
    bound = math.ceil(load_factor * (sum(counts.values()) + len(mine)) / len(usable)) + 1
    moves = []
    for entry in mine:
        order = [n for n in ring.preference(entry.session) if n in usable]
        target = next((n for n in order if counts[n] < bound), order[0] if order else None)
        if target is None:
            continue
        counts[target] += 1
        moves.append(Move(entry.session, entry.model, leaver, target, entry.path, entry.body, "leave", entry.hashes))
    return moves


def plan_shed(
    hot: str,
    sessions: Iterable[LedgerEntry],
    states: Sequence[ReplicaState],
    fraction: float,
    now: float,
    session_cooldown_s: float,
) -> list[Move]:
    """Move ``fraction`` of ``hot``'s sessions (the most recently active first: their next turn
    comes soonest) to the lightest replicas in rotation, spread over them."""
    mine = [e for e in sessions if e.replica == hot and _movable(e, now, session_cooldown_s)]
    targets = sorted(
        (s for s in states if s.in_rotation and s.name != hot),
        key=lambda s: (s.kv_usage, s.queue + s.inflight, s.name),
    )
    if not mine or not targets:
        return []
    count = max(1, int(len(mine) * fraction))
    lightest = targets[: max(1, len(targets) // 2)]
    chosen = sorted(mine, key=lambda e: e.last_seen, reverse=True)[:count]
    return [
        Move(e.session, e.model, hot, lightest[i % len(lightest)].name, e.path, e.body, "hot", e.hashes)
        for i, e in enumerate(chosen)
    ]
