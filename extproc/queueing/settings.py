"""Config ``queueing:``: when a replica is saturated, and each request class's terms."""

from __future__ import annotations

from typing import Literal

from extproc.validation import Section, option


class QueueClass(Section):
    """What a request class gets when the fleet is full: its priority (higher goes first), how
    long it may wait, how many of its priority may wait at once, and the refusal past either
    (``queueing.default``, ``queueing.classes.NAME``)."""

    priority: int = option(1, "higher is released first and never waits behind lower")
    max_wait_s: float = option(10.0, "held at most this long, then refused", gt=0)
    max_queued: int = option(1000, "requests of its priority held at most", ge=1)
    status: Literal[429, 503] = option(429, "the refusal's status (with Retry-After)")
    retry_after_s: int = option(1, "the refusal's Retry-After", ge=1)


class QueueSettings(Section):
    """``queueing:``: hold requests while every candidate replica is saturated (off by default).

    A replica is saturated when its KV usage is over ``kv_threshold`` (as scraped), its queue
    over ``queue_threshold`` (as scraped, or, when larger, this router's requests in flight beyond
    what it was running at the scrape: sent since, so queued there by now), or, with
    ``max_inflight_per_replica``, when the router has that many requests in flight on it.
    Classes not named in ``classes`` get ``default`` (interactive: above batch).
    """

    enabled: bool = option(False, "hold requests instead of sending them to saturated replicas")
    kv_threshold: float = option(0.9, "KV usage over which a replica is saturated", ge=0, le=1)
    queue_threshold: int = option(
        32, "queued requests over which it is saturated (sent since the last scrape count)", ge=0
    )
    max_inflight_per_replica: int = option(
        0, "requests in flight from this router at which it is saturated (0: off)", ge=0
    )
    default: QueueClass = option(QueueClass(), "classes not named below (interactive)")
    classes: dict[str, QueueClass] = option(
        {"batch": QueueClass(priority=0, max_wait_s=60.0, max_queued=5000, retry_after_s=10)},
        "terms by request class (classes:)",
    )

    def for_class(self, name: str) -> QueueClass:
        """The terms of request class ``name``."""
        return self.classes.get(name, self.default)

    @property
    def longest_wait_s(self) -> float:
        """The longest any request may be held (Envoy's message and route timeouts must exceed it)."""
        if not self.enabled:
            return 0.0
        return max([self.default.max_wait_s, *(c.max_wait_s for c in self.classes.values())])
