"""A small local cache of recent session pins, so a hot session's decision need not wait on Redis.

Unlike :class:`~extproc.state.memory.SessionMap`, reading an entry does not extend it: an entry
lives ``ttl_s`` from when it was learned, then the next lookup asks Redis again. That bounds how
long this gateway can disagree with another one that re-pinned the session (a failover or a
spillover elsewhere) to ``ttl_s``, and ``ttl_s`` is short (a second) compared with the time
between a conversation's turns, while an agent's burst of tool calls within a second is served
here.
"""

from __future__ import annotations

from collections import OrderedDict


class NearCache:
    """session -> replica, each entry valid for ``ttl_s`` after it was read from Redis (or first
    written, when Redis had none); LRU-bounded."""

    def __init__(self, ttl_s: float = 1.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        """Whether entries are kept at all (a TTL or size of 0 turns the cache off)."""
        return self.ttl_s > 0 and self.max_entries > 0

    def get(self, key: str, now: float) -> str | None:
        """The cached replica if it was stored less than ``ttl_s`` ago."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        replica, expires = entry
        if expires <= now:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return replica

    def put(self, key: str, replica: str, now: float) -> None:
        """Remember ``replica`` for ``key`` until ``now + ttl_s``."""
        if not self.enabled:
            return
        self._entries[key] = (replica, now + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def write(self, key: str, replica: str, now: float) -> None:
        """This gateway's own pin: the answer changes at once (it reads its writes while they are
        queued), but an entry's expiry stays where the last read from Redis put it. Two gateways
        that came to disagree (each routed on its own memory through an outage) would otherwise
        keep their own answers alive by writing them, each turn within ``ttl_s`` of the last, and
        never read the pin Redis settled on."""
        entry = self._entries.get(key)
        if entry is None or entry[1] <= now:
            self.put(key, replica, now)
            return
        self._entries[key] = (replica, entry[1])
        self._entries.move_to_end(key)

    def discard(self, key: str) -> None:
        """Forget ``key``."""
        self._entries.pop(key, None)

    def drop_replica(self, replica: str) -> None:
        """Forget every entry pointing at ``replica``."""
        for key in [k for k, (r, _) in self._entries.items() if r == replica]:
            del self._entries[key]
