"""What the KV-event feeds report, per replica: what they applied, lost and replayed, the engines'
layouts, the feeds set aside, and how the index's predictions compared with what replicas reported."""

from __future__ import annotations

from typing import Protocol


class KvEventObserver(Protocol):
    """Where the feeds, the layouts and the cache state report (the router's KV-event metrics
    implement it). ``replica`` is a replica's name, or ``unknown`` for a message naming none."""

    def feed_added(self, replica: str) -> None:
        """``replica``'s feed is followed from now on."""
        ...

    def feed_suspended(self, replica: str, cause: str) -> None:
        """``replica``'s feed was set aside for ``cause`` (block_size, hash_algo, predictions)."""
        ...

    def feed_resumed(self, replica: str, cause: str) -> None:
        """``replica``'s feed is no longer set aside for ``cause``."""
        ...

    def messages_dropped(self, replica: str, count: int = 1) -> None:
        """``count`` messages or events of ``replica`` did not decode (or its engine dropped them)."""
        ...

    def replay_ended(self, replica: str, outcome: str) -> None:
        """A replay asked of ``replica`` ended: ok, failed or incomplete."""
        ...

    def engine_restarted(self, replica: str) -> None:
        """``replica``'s sequence went back: a new engine."""
        ...

    def gap_seen(self, replica: str) -> None:
        """``replica``'s sequence skipped numbers."""
        ...

    def batch_applied(self, replica: str, lag_s: float | None) -> None:
        """One batch of ``replica`` was applied, ``lag_s`` after it was published (None: not known)."""
        ...

    def events_applied(self, replica: str, kind: str, count: int) -> None:
        """``count`` events of ``kind`` (stored, removed, cleared) were applied."""
        ...

    def blocks_changed(self, replica: str, op: str, count: int) -> None:
        """``count`` blocks were ``op`` (stored, removed) in ``replica``'s entries."""
        ...

    def replica_cleared(self, replica: str, cause: str) -> None:
        """``replica``'s entries were dropped, for ``cause`` (gap, restart, overflow, ...)."""
        ...

    def feed_state(self, replica: str, blocks: int, live: bool, last_seq: int | None) -> None:
        """``replica``'s indexed entries, whether its matches come from its events, its last
        sequence number applied (None: none yet); refreshed before each metrics scrape."""
        ...

    def index_keys(self, keys: int) -> None:
        """Distinct block keys in the index; refreshed before each metrics scrape."""
        ...

    def layout_reported(self, replica: str, block_size: int | None, size_off: bool, algo_off: bool) -> None:
        """What ``replica`` reports of its engine's layout, and whether it differs from the config's
        block size or hash algorithm."""
        ...

    def layout_forgotten(self, replica: str) -> None:
        """``replica`` left: its layout is no longer reported."""
        ...

    def tokens_predicted(self, replica: str, tokens: int) -> None:
        """The index predicted ``tokens`` cached prompt tokens on ``replica``, chosen for a request."""
        ...

    def tokens_reported(self, replica: str, tokens: float) -> None:
        """``replica`` reported ``tokens`` more cached prompt tokens while its feed was live."""
        ...

    def prediction_checked(self, replica: str, outcome: str) -> None:
        """A prediction was checked against what ``replica`` reported: agree, over, under, unreported."""
        ...

    def tokenize_failed(self) -> None:
        """A request could not be tokenized: it is routed on character blocks."""
        ...


class NullKvEventObserver:
    """The default: nothing is reported."""

    def feed_added(self, replica: str) -> None:
        """Not reported."""

    def feed_suspended(self, replica: str, cause: str) -> None:
        """Not reported."""

    def feed_resumed(self, replica: str, cause: str) -> None:
        """Not reported."""

    def messages_dropped(self, replica: str, count: int = 1) -> None:
        """Not reported."""

    def replay_ended(self, replica: str, outcome: str) -> None:
        """Not reported."""

    def engine_restarted(self, replica: str) -> None:
        """Not reported."""

    def gap_seen(self, replica: str) -> None:
        """Not reported."""

    def batch_applied(self, replica: str, lag_s: float | None) -> None:
        """Not reported."""

    def events_applied(self, replica: str, kind: str, count: int) -> None:
        """Not reported."""

    def blocks_changed(self, replica: str, op: str, count: int) -> None:
        """Not reported."""

    def replica_cleared(self, replica: str, cause: str) -> None:
        """Not reported."""

    def feed_state(self, replica: str, blocks: int, live: bool, last_seq: int | None) -> None:
        """Not reported."""

    def index_keys(self, keys: int) -> None:
        """Not reported."""

    def layout_reported(self, replica: str, block_size: int | None, size_off: bool, algo_off: bool) -> None:
        """Not reported."""

    def layout_forgotten(self, replica: str) -> None:
        """Not reported."""

    def tokens_predicted(self, replica: str, tokens: int) -> None:
        """Not reported."""

    def tokens_reported(self, replica: str, tokens: float) -> None:
        """Not reported."""

    def prediction_checked(self, replica: str, outcome: str) -> None:
        """Not reported."""

    def tokenize_failed(self) -> None:
        """Not reported."""
