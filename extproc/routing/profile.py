"""A routing profile: its filters, weighted scorers and picker, its ring, and what new work is
hashed on; and the profiles of a fleet (the default and the named ones request classes choose)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from extproc.request.features import RequestFeatures
from extproc.routing.model import Snapshot
from extproc.routing.plugins import Filter, Picker, Scorer
from extproc.routing.ring import HashRing

KeySource = Literal["session", "prefix", "request", "none"]


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    """A scorer and the weight the profile gives it."""

    scorer: Scorer
    weight: float


@dataclass(slots=True)
class Profile:
    """A named arrangement of plugins; see :func:`extproc.routing.registry.build_profile`."""

    filters: Sequence[Filter]
    scorers: Sequence[WeightedScorer]
    picker: Picker
    vnodes: int = 128
    ring_key_blocks: int = 32
    max_fallbacks: int = 2
    name: str = "default"
    repin_on_spillover: bool = False
    _ring: HashRing | None = field(default=None, repr=False)
    _ring_members: tuple[tuple[str, float], ...] = field(default=(), repr=False)

    def ring_for(self, snapshot: Snapshot) -> HashRing:
        """The ring over the snapshot's members, rebuilt only when membership changes."""
        members = tuple(sorted((s.name, s.replica.weight) for s in snapshot.replicas))
        if self._ring is None or members != self._ring_members:
            self._ring = HashRing(members, self.vnodes)
            self._ring_members = members
        return self._ring

    def prefix_key(self, features: RequestFeatures) -> str | int | None:
        """The prefix's own ring key: its deepest block up to ``ring_key_blocks`` (deep enough to tell
        requests apart), per tenant; None without prefix hashes. Hot prefixes are known by it."""
        hashes = features.prefix_hashes
        if not hashes:
            return None
        anchor = hashes[min(self.ring_key_blocks, len(hashes)) - 1]
        # Tenants hash in their own space: equal prompts of two tenants need not meet.
        return f"{features.tenant}\x1f{anchor}" if features.tenant else anchor

    def ring_key(self, features: RequestFeatures, prefix: str | int | None) -> tuple[str | int | None, KeySource]:
        """What new work is hashed on, and where that came from: the session, else the prefix's
        key (``prefix``, :meth:`prefix_key`), else the request id (which spreads requests we know
        nothing about instead of sending them all to the first replica)."""
        if features.session_key:
            return features.session_key, "session"
        if prefix is not None:
            return prefix, "prefix"
        if features.request_id:
            return features.request_id, "request"
        return None, "none"


@dataclass(slots=True)
class Profiles:
    """The default profile and the named ones request classes choose."""

    default: Profile
    named: Mapping[str, Profile] = field(default_factory=dict)

    def for_request(self, features: RequestFeatures) -> Profile:
        """The profile of the request's class (``features.profile``), else the default."""
        return self.named.get(features.profile or "", self.default)

    def __iter__(self) -> Iterator[Profile]:
        yield self.default
        yield from self.named.values()
