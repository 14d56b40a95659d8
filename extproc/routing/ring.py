"""A consistent-hash ring with virtual nodes, walked with a load bound.

Each replica owns ``vnodes * weight`` points. A key's preference order is the order in which
distinct replicas appear walking clockwise from the key's point; adding or removing one of N
replicas changes the first choice of about 1/N of the keys.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def key_point(key: str | int) -> int:
    """A key's position on the ring."""
    if isinstance(key, int):
        # Masked: a negative key (Python's own hash, as vLLM's builtin block hash) or one past 64
        # bits gets a point too; our own keys, unsigned 64-bit, keep theirs.
        return _xxh3((key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    return _xxh3(key.encode("utf-8", "surrogatepass"))


class HashRing:
    """An immutable ring over a set of (name, weight) members."""

    __slots__ = ("_names", "_owners", "_points")

    def __init__(self, members: Iterable[tuple[str, float]], vnodes: int = 128) -> None:
        points: list[tuple[int, str]] = []
        for name, weight in members:
            count = max(1, round(vnodes * weight))
            points.extend((_xxh3(f"{name}#{i}".encode()), name) for i in range(count))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._names = frozenset(self._owners)

    @property
    def members(self) -> frozenset[str]:
        """The replica names on the ring."""
        return self._names

    def preference(self, key: str | int, limit: int | None = None) -> list[str]:
        """Distinct replicas in ring order from ``key``'s point (at most ``limit``)."""
        if not self._points:
            return []
        want = len(self._names) if limit is None else min(limit, len(self._names))
        start = bisect.bisect(self._points, key_point(key))
        seen: list[str] = []
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == want:
                    break
        return seen

    def bounded_owner(
        self, key: str | int, accepts: Callable[[str], bool], order: Sequence[str] | None = None
    ) -> str | None:
        """The first replica in ``key``'s preference order that ``accepts`` (e.g. is under its load bound)."""
        for name in order if order is not None else self.preference(key):
            if accepts(name):
                return name
        return None
