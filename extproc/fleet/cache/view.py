"""The three sources of what a replica holds, combined into the one view a decision reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from extproc.fleet.cache.estimate import CacheEstimate
from extproc.fleet.cache.inflight import InflightPrefixes, longer
from extproc.fleet.health.replicas import ReplicaBook
from extproc.request.features import RequestFeatures
from extproc.routing.model import AffinityView
from extproc.routing.trace import CacheEvidence
from extproc.state.store import AffinityStore

if TYPE_CHECKING:  # its module loads the tokenizers: only servers with KV events pay for that
    from extproc.fleet.kvevents.cache_state import EventCacheState


@dataclass(frozen=True, slots=True)
class CacheView:
    """What the caches are believed to hold for one request."""

    view: AffinityView
    """The decision's input: the store's pin and index weighed by trust, the prompts in flight,
    the KV events where a feed is live, and whether the pin's cache is known lost."""
    claims: Mapping[str, int] = field(default_factory=dict)
    """Blocks per replica the index and the prompts in flight claim, before trust: what the
    replica's own counters later judge."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Per replica with a match, which source gave it: ``estimate``, ``in_flight`` or
    ``kv_events`` (filled for Explain only)."""


def _with_inflight(view: AffinityView, inflight: Mapping[str, int]) -> AffinityView:
    """The view with each replica's match at least what the router's requests in flight there
    cover: those it runs or has queued prefill their prompts before a request sent now (not scaled
    by trust: the replica's counters judge the index, not this)."""
    matches = longer(view.prefix_matches, inflight)
    return view if matches is view.prefix_matches else replace(view, prefix_matches=matches)


class ReplicaCaches:
    """The estimate, the prompts in flight and the KV-event view behind one interface.

    ``book`` gives the membership and the scrapes the estimate learns from, ``store`` takes the
    capacities the replicas report; ``events`` is the KV-event state where any replica publishes.
    """

    def __init__(
        self,
        book: ReplicaBook,
        store: AffinityStore,
        block_tokens: int,
        events: EventCacheState | None = None,
    ) -> None:
        self.book = book
        self.store = store
        self.events = events
        self.estimate = CacheEstimate(block_tokens)
        self.inflight = InflightPrefixes()

    def refresh(self, now: float) -> None:
        """Take in the scrapes since the last call (cheap when there were none). The request path
        calls it; Explain does not, so that asking changes nothing."""
        self.estimate.sync(self.book, self.store, now)

    def view(self, stored: AffinityView, features: RequestFeatures, now: float, *, explain: bool = False) -> CacheView:
        """What the caches hold for ``features``, from what the store returned (``stored``).

        The index's matches are scaled by each replica's trust, raised to what its requests in
        flight cover, replaced by its own events where its feed is live; then the pin is judged
        (lost when the replica's own word says its cache of the conversation is gone).
        """
        hashes = features.prefix_hashes
        inflight = self.inflight.matches(hashes)
        claims = longer(stored.prefix_matches, inflight)
        adjusted = self.estimate.adjust(stored)
        view = _with_inflight(adjusted, inflight)
        sources: dict[str, str] = {}
        if explain:
            estimate = adjusted.prefix_matches
            sources = {
                r: "estimate" if estimate.get(r, 0) >= n else "in_flight" for r, n in view.prefix_matches.items()
            }
        if self.events is not None:
            members = [r.replica.name for r in self.book.records()]
            view = self.events.view(view, features, members, now)
            if explain and features.tokens_per_block and hashes:
                live = set(self.events.source.live(members, now))
                sources = {r: "kv_events" if r in live else sources.get(r, "estimate") for r in view.prefix_matches}
        view = self.estimate.judge_pin(view, len(hashes))
        return CacheView(view, claims, sources)

    def evidence(self, names: Sequence[str], now: float) -> dict[str, CacheEvidence]:
        """Trust and freshness of each named replica's cache picture (Explain, the admin API)."""
        live: set[str] = set()
        feeds: Mapping[str, object] = {}
        if self.events is not None:
            live = set(self.events.source.live(names, now))
            feeds = self.events.source.feeds
        return {
            n: CacheEvidence(
                self.estimate.trust(n),
                self.estimate.evidence_age(n, now),
                "live" if n in live else "silent" if n in feeds else "",
            )
            for n in names
        }

    # -- what routing a request changes ---------------------------------------------------------
    def sent(self, replica: str, features: RequestFeatures, matched_blocks: int, now: float) -> None:
        """A request went to ``replica``: its prompt is in flight there, and its events (where it
        publishes) are credited with the prompt's blocks."""
        self.inflight.add(replica, features.prefix_hashes)
        if self.events is not None:
            self.events.decided(features, replica, matched_blocks, now)

    def prefilled(self, replica: str, claimed_tokens: int, sent_tokens: int) -> None:
        """A request's prefill there is over: its claim is weighed against the hits the replica
        reports from now on."""
        self.estimate.claimed(replica, claimed_tokens, sent_tokens)

    def ended(self, replica: str, features: RequestFeatures) -> None:
        """A request there is over: its prompt is no longer in flight."""
        self.inflight.remove(replica, features.prefix_hashes)

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet."""
        self.inflight.forget((replica,))
