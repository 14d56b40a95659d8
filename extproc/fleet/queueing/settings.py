"""Config ``queueing:``: when a replica is saturated, and each request class's terms."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from extproc.base.validation import Section, field_error, option

OnMiss = Literal["best_effort", "queue", "shed"]
"""What a request gets when no replica is predicted to meet its latency objectives."""


class QueueClass(Section):
    """What a request class gets when the fleet is full: its priority (higher goes first), how
    long it may wait, how many of its priority may wait at once, and the refusal past either
    (``queueing.default``, ``queueing.classes.NAME``); and what it gets when every candidate's
    latency model (warm ones only) predicts a miss of its objectives (``on_miss``): routed anyway
    to the least late (``best_effort``, as without it), held in this queue until a candidate is
    predicted to meet them or the fleet has nothing in flight (``queue``, within ``max_wait_s``),
    or refused at once with 429 and ``retry_after_s`` (``shed``). With ``admit_margin``, a class
    that sheds or queues is admitted only when a candidate is predicted to leave that share of its
    objectives unused: the models are about 10% off, so a request predicted to just meet them is
    as often late, and the load it adds makes the classes above it late too (0.2 by default:
    benchmarks/latency_objectives.md)."""

    priority: int = option(1, "higher is released first and never waits behind lower")
    max_wait_s: float = option(10.0, "held at most this long, then refused", gt=0)
    max_queued: int = option(1000, "requests of its priority held at most", ge=1)
    status: Literal[429, 503] = option(429, "the refusal's status (with Retry-After)")
    retry_after_s: int = option(1, "the refusal's Retry-After", ge=1)
    on_miss: OnMiss = option(
        "best_effort", "no replica predicted to meet its latency objectives: best_effort, queue (needs enabled) or shed"
    )
    admit_margin: float = option(
        0.2,
        "with on_miss shed or queue: the share of its objectives a replica must be predicted to leave unused",
        ge=0,
        lt=1,
    )


class QueueSettings(Section):
    """``queueing:``: hold requests while every candidate replica is saturated (off by default).

    A replica is saturated when its KV usage is over ``kv_threshold`` (as scraped), its queue
    over ``queue_threshold`` (as scraped, or, when larger, this router's requests in flight beyond
    what it was running at the scrape: sent since, so queued there by now), or, with
    ``max_inflight_per_replica``, when the router has that many requests in flight on it.
    Classes not named in ``classes`` get ``default`` (interactive: above batch).

    ``kv_room`` is apart from that (and from ``enabled``): a request decided on a replica waits
    until its KV has room for it (:mod:`extproc.fleet.queueing.kv_room`).
    """

    enabled: bool = option(False, "hold requests instead of sending them to saturated replicas")
    kv_threshold: float = option(0.9, "KV usage over which a replica is saturated", ge=0, le=1)
    queue_threshold: int = option(
        32, "queued requests over which it is saturated (sent since the last scrape count)", ge=0
    )
    max_inflight_per_replica: int = option(
        0, "requests in flight from this router at which it is saturated (0: off)", ge=0
    )
    kv_room: bool = option(
        False, "hold a request decided on a replica until its KV has room for it, and keep a turn's room for the next"
    )
    kv_room_grace_s: float = option(
        0.25, "with kv_room: the longest a turn's room is kept for its conversation's next turn", ge=0
    )
    kv_room_patience_s: float = option(
        2.0, "with kv_room: a request waiting this long goes before room kept for a conversation", gt=0
    )
    kv_room_max_wait_s: float = option(3.0, "with kv_room: held at most this long, then sent anyway", gt=0)
    kv_room_share: float = option(
        1.0, "with kv_room: the share of a replica's KV this router's requests in flight there may claim", gt=0, le=1
    )
    default: QueueClass = option(QueueClass(), "classes not named below (interactive)")
    classes: dict[str, QueueClass] = option(
        {"batch": QueueClass(priority=0, max_wait_s=60.0, max_queued=5000, retry_after_s=10)},
        "terms by request class (classes:)",
    )

    @model_validator(mode="after")
    def _queue_on_miss_needs_the_queue(self) -> QueueSettings:
        if not self.enabled:
            for name, terms in [("default", self.default), *((f"classes.{n}", c) for n, c in self.classes.items())]:
                if terms.on_miss == "queue":
                    message = f"{name}.on_miss is queue: set queueing.enabled too (or on_miss: shed / best_effort)"
                    raise field_error(QueueSettings, "enabled", message, False)
        return self

    def for_class(self, name: str) -> QueueClass:
        """The terms of request class ``name``."""
        return self.classes.get(name, self.default)

    @property
    def longest_wait_s(self) -> float:
        """The longest any request may be held (Envoy's message and route timeouts must exceed it)."""
        room = self.kv_room_max_wait_s if self.kv_room else 0.0
        if not self.enabled:
            return room
        return room + max([self.default.max_wait_s, *(c.max_wait_s for c in self.classes.values())])
