"""The ``queueing:`` section as runtime values: when a replica is saturated, and each class's terms."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class QueueClass:
    """What a request class gets when the fleet is full: its priority (higher goes first), how
    long it may wait, how many of its priority may wait at once, and the refusal past either."""

    priority: int = 1
    max_wait_s: float = 10.0
    max_queued: int = 1000
    status: int = 429
    retry_after_s: int = 1


def _default_classes() -> dict[str, QueueClass]:
    return {"batch": QueueClass(priority=0, max_wait_s=60.0, max_queued=5000, retry_after_s=10)}


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """When to hold requests (every candidate saturated) and the terms of each class.

    A replica is saturated when its KV usage is over ``kv_threshold`` (as scraped), its queue
    over ``queue_threshold`` (as scraped, or, when larger, this router's requests in flight beyond
    what it was running at the scrape: sent since, so queued there by now), or, with
    ``max_inflight_per_replica``, when the router has that many requests in flight on it.
    Classes not named in ``classes`` get ``default`` (interactive: above batch).
    """

    enabled: bool = False
    kv_threshold: float = 0.9
    queue_threshold: int = 32
    max_inflight_per_replica: int = 0
    default: QueueClass = QueueClass()
    classes: Mapping[str, QueueClass] = field(default_factory=_default_classes)

    def for_class(self, name: str) -> QueueClass:
        """The terms of request class ``name``."""
        return self.classes.get(name, self.default)

    @property
    def longest_wait_s(self) -> float:
        """The longest any request may be held (Envoy's message and route timeouts must exceed it)."""
        if not self.enabled:
            return 0.0
        return max([self.default.max_wait_s, *(c.max_wait_s for c in self.classes.values())])
