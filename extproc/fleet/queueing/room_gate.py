"""The KV room (:mod:`extproc.fleet.queueing.kv_room`) on the event loop: a request waits on a
future for its room, at most ``queueing.kv_room_max_wait_s``, and kept room lapses on a timer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from extproc.fleet.queueing.kv_room import Entry, KvRoom
from extproc.fleet.queueing.settings import QueueSettings


class RoomGate:
    """:class:`KvRoom` on the event loop: a request waits on a future, at most ``max_wait_s``."""

    def __init__(
        self, clock: Callable[[], float], *, grace_s: float, patience_s: float, max_wait_s: float, share: float
    ) -> None:
        self.room = KvRoom(clock, grace_s, patience_s)
        self.max_wait_s = max_wait_s
        self.share = share

    async def enter(self, entry: Entry, capacity: int, waited: float = 0.0) -> Entry:
        """Wait until ``entry.replica`` (of ``capacity`` KV tokens) has room for ``entry``, at
        most ``max_wait_s`` less the ``waited`` already (then it goes anyway); the claim to give
        back with :meth:`leave`."""
        if self.room.enter(entry, int(capacity * self.share)):
            return entry
        if not await self._granted(entry, self.max_wait_s - waited):
            self.room.force(entry)
        return entry

    def would_wait(self, entry: Entry, replica: str, capacity: int) -> bool:
        """Whether ``entry``, a new conversation, would wait for room on ``replica`` now."""
        return self.room.would_wait(entry, replica, int(capacity * self.share))

    async def enter_any(self, entry: Entry) -> Entry:
        """Wait until any of ``entry.among`` has room for it, at most ``max_wait_s``: ``entry``,
        inside on the replica that had room (``entry.inside``), or not (its time was up)."""
        if not self.room.enter_any(entry) and not await self._granted(entry, self.max_wait_s):
            _grant(self.room.abandon(entry))
        return entry

    async def _granted(self, entry: Entry, limit: float) -> bool:
        """Wait for ``entry``'s room at most ``limit``: False when none came (it still waits)."""
        granted = entry.granted = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(granted), max(0.0, limit))
        except TimeoutError:
            return entry.inside  # granted as its time ran out, or not
        except asyncio.CancelledError:
            # Its client went away: granted in the meantime, the room it was given goes back.
            _grant(self.room.leave(entry, keep=False) if entry.inside else self.room.abandon(entry))
            raise
        return True

    def arrived(self, session: str) -> None:
        """A turn of ``session`` came (:meth:`KvRoom.arrived`); what its kept room holds back is
        let go once the longer wait for it is over."""
        for replica in self.room.arrived(session):
            self._expire_later(replica, self.room.grace_s)

    def leave(self, entry: Entry, keep: bool = True) -> None:
        """The request is over: its room goes to what waits (a moment first to its conversation,
        unless not ``keep``)."""
        _grant(self.room.leave(entry, keep))
        if keep and entry.session is not None and (moment := self.room.kept_for(entry.session)) > 0:
            self._expire_later(entry.replica, moment)

    def _expire_later(self, replica: str, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, lambda: _grant(self.room.expire_kept(replica)))


def _grant(entries: list[Entry]) -> None:
    for entry in entries:
        if entry.granted is not None and not entry.granted.done():
            entry.granted.set_result(None)


def room_gate(settings: QueueSettings, clock: Callable[[], float], workers: int = 1) -> RoomGate | None:
    """The gate ``queueing:`` asks for (None: ``kv_room`` off); each of ``workers`` processes
    serving one port claims its share of a replica's KV."""
    if not settings.kv_room:
        return None
    return RoomGate(
        clock,
        grace_s=settings.kv_room_grace_s,
        patience_s=settings.kv_room_patience_s,
        max_wait_s=settings.kv_room_max_wait_s,
        share=settings.kv_room_share / max(1, workers),
    )
