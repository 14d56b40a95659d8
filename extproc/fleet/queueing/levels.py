"""The order held requests leave in: highest priority first, round robin by tenant within a
priority. Synchronous and clock-free, so the server's queue and the simulator share it."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class _Level(Generic[T]):
    """The waiters of one priority, by tenant, served round robin."""

    def __init__(self) -> None:
        self.tenants: OrderedDict[str, deque[T]] = OrderedDict()
        self.size = 0

    def pop(self) -> T:
        tenant, waiting = next(iter(self.tenants.items()))
        item = waiting.popleft()
        del self.tenants[tenant]
        if waiting:
            self.tenants[tenant] = waiting  # to the back of the round
        self.size -= 1
        return item


class PriorityLevels(Generic[T]):
    """Waiting items by priority and tenant."""

    def __init__(self) -> None:
        self._levels: dict[int, _Level[T]] = {}

    def __len__(self) -> int:
        return sum(level.size for level in self._levels.values())

    def push(self, priority: int, tenant: str, item: T) -> None:
        """Add ``item`` at the back of its tenant's line at ``priority``."""
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
            self._levels = dict(sorted(self._levels.items(), reverse=True))  # highest first
        level.tenants.setdefault(tenant, deque()).append(item)
        level.size += 1

    def waiting(self, priority: int) -> int:
        """Items waiting at ``priority``."""
        level = self._levels.get(priority)
        return level.size if level else 0

    def ahead(self, priority: int) -> bool:
        """Whether anything waits at ``priority`` or above (then a newcomer must wait too)."""
        return any(level.size for p, level in self._levels.items() if p >= priority)

    def head(self) -> T | None:
        """The item that leaves next."""
        for level in self._levels.values():
            for waiting in level.tenants.values():
                return waiting[0]
        return None

    def pop(self) -> T:
        """Take the item that leaves next (:meth:`head`); its tenant goes to the back of the round."""
        for level in self._levels.values():
            if level.size:
                return level.pop()
        raise IndexError("nothing waits")

    def remove(self, priority: int, tenant: str, item: T) -> bool:
        """Take ``item`` out of its line (it gave up); False when it is no longer there."""
        level = self._levels.get(priority)
        waiting = level.tenants.get(tenant) if level else None
        if level is None or waiting is None or item not in waiting:
            return False
        waiting.remove(item)
        if not waiting:
            del level.tenants[tenant]
        level.size -= 1
        return True
