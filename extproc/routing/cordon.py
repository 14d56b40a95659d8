"""Cordons: replicas an operator took out of new work.

A *cordoned* replica receives no new session and no new prefix, but the sessions pinned to it keep
going there (their KV cache is there). A *drained* replica receives nothing: its sessions have
been moved to their next replica (by the rebalancer) and a request of one still pinned there fails
over. The set comes from the affinity store (shared by every gateway with Redis) and is passed
into the decision, which stays pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from extproc.routing.model import ReplicaState

CordonState = Literal["cordoned", "drained"]
CORDON_STATES: tuple[CordonState, ...] = ("cordoned", "drained")
FULL = "full"
"""The router's own mark, not an operator's: no KV room for a new conversation there now
(``queueing.kv_room``); kept like a cordon for the session pinned there."""


@dataclass(slots=True)
class CordonFilter:
    """Drops cordoned replicas (except for the session pinned there) and drained ones.

    Fails open like the rotation filter: with every candidate cordoned, they all stay (an operator
    who cordons the whole fleet gets routing as before, not a 503).
    """

    cordons: Mapping[str, str] = field(default_factory=dict)
    pin_lost: bool = False
    """The pinned replica is known to have lost the conversation (``AffinityView.pin_lost``): a
    full mark keeps it no more (its next turn is a new conversation's prefill anywhere)."""
    name: str = "cordon"

    def keeps(self, state: ReplicaState, pinned: str | None) -> bool:
        """Whether the replica may take this request."""
        mark = self.cordons.get(state.name)
        if mark is None:
            return True
        return state.name == pinned and (mark == "cordoned" or (mark == FULL and not self.pin_lost))

    def why(self, state: ReplicaState) -> str:
        """Why it was dropped."""
        mark = self.cordons.get(state.name)
        if mark == FULL:
            return "no KV room for a new conversation now (queueing.kv_room)"
        return "drained" if mark == "drained" else "cordoned (no new sessions or prefixes)"
