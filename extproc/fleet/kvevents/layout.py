"""The engines' cache layout as they report it: block size and hash algorithm, per replica.

``kv_events.block_size`` and ``kv_events.hash_algo`` are defaults until an engine says otherwise. A
wrong block size matches no block and says nothing (the request's hashes and the engine's never
meet), so the router listens to what each engine reports and hashes with that:

- ``vllm:cache_config_info{block_size=..., prefix_caching_hash_algo=...}`` on its /metrics page;
- the ``block_size`` of every ``BlockStored`` it publishes (what its hashes were computed over:
  it wins over the page when both speak and disagree).

Requests are hashed once, before the decision, so a model's replicas share one layout: the one
they report when they agree; when they disagree (a warning names them), the most common, the
configured value winning a tie. A replica whose layout is not its model's cannot be matched by
its events: it is a *misfit*, and its feed is not used (the estimate answers for it).

A configured value that disagrees with an engine's report is logged once per (replica, value) and
shown by ``extproc_kv_events_block_size_mismatch{replica}`` and
``extproc_kv_events_hash_algo_mismatch{replica}`` (1 while they disagree).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from extproc.fleet.kvevents.hashing import HashAlgo
from extproc.fleet.kvevents.observer import KvEventObserver, NullKvEventObserver

log = logging.getLogger("extproc.fleet.kvevents")

REPRODUCIBLE = {HashAlgo.SHA256.value: HashAlgo.SHA256, HashAlgo.SHA256_CBOR.value: HashAlgo.SHA256_CBOR}
"""Engine hash algorithms the router can compute from token ids."""
UNREPRODUCIBLE = frozenset({"xxhash", "xxhash_cbor", "builtin"})
"""Engine hash algorithms it cannot (xxh3-128, Python's per-process ``hash``): ``content`` only.
A name in neither set (a release we do not know) is warned about but not acted on: the prediction
checks judge it."""


@dataclass(slots=True)
class EngineReport:
    """What one replica's engine said of its layout (None: not said)."""

    events_block_size: int | None = None
    page_block_size: int | None = None
    hash_algo: str | None = None
    models: frozenset[str] = frozenset()
    """The models its page names (``model_name``); empty: unknown, counted for every model."""

    @property
    def block_size(self) -> int | None:
        """The block size its hashes are computed over: its events' if any, else its page's."""
        return self.events_block_size if self.events_block_size is not None else self.page_block_size


_V = TypeVar("_V", int, str)


def _prevailing(values: Iterable[_V], default: _V) -> _V:
    """The most common of ``values``; a tie goes to ``default`` if tied, else to the smallest."""
    counts = Counter(values).most_common()
    if not counts:
        return default
    top = counts[0][1]
    tied = [v for v, n in counts if n == top]
    return default if default in tied else min(tied)


class EngineLayouts:
    """Every replica's reported layout, and the one each model's requests are hashed with."""

    def __init__(self, block_size: int, hash_algo: HashAlgo, metrics: KvEventObserver | None = None) -> None:
        self.configured_block_size = block_size
        self.configured_algo = hash_algo
        self.metrics: KvEventObserver = metrics or NullKvEventObserver()
        self.reports: dict[str, EngineReport] = {}
        self._warned: set[tuple[str, ...]] = set()
        self._by_model: dict[str, tuple[int, HashAlgo]] = {}  # memo, cleared on any change

    # -- what the engines say ---------------------------------------------------------------
    def from_events(self, replica: str, block_size: int) -> bool:
        """A ``BlockStored`` of ``replica`` carried ``block_size`` (called per batch: cheap when
        unchanged); True when that changed what is known."""
        rep = self.reports.get(replica)
        if rep is not None and rep.events_block_size == block_size:
            return False
        rep = rep or self.reports.setdefault(replica, EngineReport())
        rep.events_block_size = block_size
        self._changed(replica)
        return True

    def from_page(
        self, replica: str, block_size: int | None, hash_algo: str | None, models: Iterable[str] = ()
    ) -> bool:
        """A scrape of ``replica``'s /metrics page (``vllm:cache_config_info``, ``model_name``);
        True when that changed what is known."""
        rep = self.reports.get(replica)
        new = (block_size, hash_algo, frozenset(models))
        if rep is not None and (rep.page_block_size, rep.hash_algo, rep.models) == new:
            return False
        rep = rep or self.reports.setdefault(replica, EngineReport())
        rep.page_block_size, rep.hash_algo, rep.models = new
        self._changed(replica)
        return True

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet."""
        if self.reports.pop(replica, None) is not None:
            self._by_model.clear()
            self.metrics.layout_forgotten(replica)

    def _changed(self, replica: str) -> None:
        self._by_model.clear()
        rep = self.reports[replica]
        size, algo = rep.block_size, rep.hash_algo
        if rep.page_block_size is not None and size != rep.page_block_size:
            self._warn_once(
                ("two", replica, str(size), str(rep.page_block_size)),
                "kv events: replica %s publishes blocks of %d tokens but its /metrics page says block_size %d: "
                "its events' size is used",
                replica, size, rep.page_block_size,
            )  # fmt: skip
        size_off = size is not None and size != self.configured_block_size
        # ``content`` keys blocks by their token ids: it works whatever the engine hashes with.
        algo_off = algo is not None and self.configured_algo is not HashAlgo.CONTENT and algo != self.configured_algo
        if size_off:
            self._warn_once(
                ("size", replica, str(size)),
                "kv events: replica %s reports block_size %d but kv_events.block_size is %d: its model's prompts "
                "are hashed with what its engines report",
                replica, size, self.configured_block_size,
            )  # fmt: skip
        if algo_off:
            self._warn_once(
                ("algo", replica, str(algo)),
                "kv events: replica %s reports prefix_caching_hash_algo %s but kv_events.hash_algo is %s%s",
                replica, algo, self.configured_algo.value,
                ": not reproducible from token ids, its events cannot be matched (set kv_events.hash_algo: content)"
                if algo in UNREPRODUCIBLE
                else "" if algo in REPRODUCIBLE else " (an algorithm not known here: the prediction checks judge it)",
            )  # fmt: skip
        self.metrics.layout_reported(replica, size, size_off, algo_off)

    def _warn_once(self, key: tuple[str, ...], message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # -- what the router hashes with ---------------------------------------------------------
    def layout(self, model: str) -> tuple[int, HashAlgo]:
        """(block size, hash algorithm) to hash ``model``'s prompts with: its replicas' reports (a
        replica whose page names no model counts for every model; a model no page names takes
        every replica's), the configured values where none reported."""
        memo = self._by_model.get(model)
        if memo is not None:
            return memo
        group = [(r, rep) for r, rep in self.reports.items() if not rep.models or model in rep.models]
        sizes = {r: rep.block_size for r, rep in group or self.reports.items() if rep.block_size is not None}
        size = _prevailing(list(sizes.values()), self.configured_block_size)
        if len(set(sizes.values())) > 1:
            self._warn_once(
                ("split", model, *sorted(f"{r}={s}" for r, s in sizes.items())),
                "kv events: the replicas of model %r report different block sizes (%s): hashing with %d; "
                "the others' events are not used",
                model, ", ".join(f"{r} {s}" for r, s in sorted(sizes.items())), size,
            )  # fmt: skip
        algo = self.configured_algo
        if algo is not HashAlgo.CONTENT:
            reported = [rep.hash_algo for _, rep in group or self.reports.items() if rep.hash_algo in REPRODUCIBLE]
            algo = REPRODUCIBLE[_prevailing([a for a in reported if a is not None], algo.value)]
        self._by_model[model] = (size, algo)
        return size, algo

    def block_size(self, model: str) -> int:
        """Tokens per block for ``model``'s prompts."""
        return self.layout(model)[0]

    def misfit(self, replica: str) -> str | None:
        """Why ``replica``'s events cannot match its model's hashes ("block_size", "hash_algo"),
        None when they can (or it said nothing)."""
        rep = self.reports.get(replica)
        if rep is None:
            return None
        # A replica naming no model is judged by the layout of a model no page names.
        for model in rep.models or {"\0"}:
            size, algo = self.layout(model)
            if rep.block_size is not None and rep.block_size != size:
                return "block_size"
            if algo is not HashAlgo.CONTENT and (
                rep.hash_algo in UNREPRODUCIBLE or (rep.hash_algo in REPRODUCIBLE and rep.hash_algo != algo)
            ):
                return "hash_algo"
        return None
