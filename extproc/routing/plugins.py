"""The pipeline's extension points: the state one decision reads, and the filter, scorer and
picker protocols.

Filters drop candidates; scorers return a score in [0, 1] per candidate and never see their
weight (the profile weighs them); one picker orders the weighted results. Plugins only read:
what a decision changes (pins, the prefix index, in-flight counts) is recorded afterwards by
the router.

The built-in plugins are in :mod:`extproc.routing.filters`, :mod:`extproc.routing.scorers` and
:mod:`extproc.routing.pickers` (and, with what they need, :mod:`~extproc.routing.lora`,
:mod:`~extproc.routing.latency`, :mod:`~extproc.routing.price`, :mod:`~extproc.routing.hot`,
:mod:`~extproc.routing.cordon`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.request.features import RequestFeatures
from extproc.routing.latency import LatencyView, Prediction
from extproc.routing.model import NO_TERMS, AffinityView, ReplicaState, Snapshot, TenantTerms
from extproc.routing.price_parts import Price
from extproc.routing.ring import HashRing

_BLOCK_CHARS = 64
"""The characters of a prefix block by default (``features.block_chars``)."""


@dataclass(slots=True)
class CycleState:
    """Everything one decision reads, and what its filters found that later steps use."""

    features: RequestFeatures
    snapshot: Snapshot
    view: AffinityView
    now: float
    ring: HashRing
    ring_key: str | int | None
    key_source: str = "none"
    tenant: TenantTerms = NO_TERMS
    hot_key: str | int | None = None
    """The request's prefix ring key (without the session), which hot prefixes are known by."""
    hot_replicas: int = 0
    """Replicas its prefix should be served by when it is hot (:mod:`extproc.routing.hot`); 0: not hot."""
    overloaded: frozenset[str] = frozenset()
    """Replicas the overload filter dropped: a pinned or best-matching one dropped there makes the
    decision a spillover."""
    hot_set: frozenset[str] | None = None
    """A hot prefix's replica set, as the hot-prefix filter chose it (None: not hot, or a session
    pinned elsewhere kept its replica)."""
    latency: LatencyView | None = None
    """The replicas' latency models (:mod:`extproc.routing.latency`); None: none kept."""
    predicted: dict[str, Prediction] | None = None
    """Candidates' predicted latencies for this request, once the latency plugins computed them."""
    block_chars: int = _BLOCK_CHARS
    """The characters of a prefix block (what a match is worth in tokens without a tokenizer)."""
    record: bool = True
    """Whether the decision is carried out (not an Explain): a picker records its choice only then."""
    prices: dict[str, Price] | None = None
    """Candidates' prices for this request (:mod:`extproc.routing.price`), once computed."""
    adapter: str | None = None
    """The LoRA adapter the request names (empty: a base model), once the price judged it."""
    price_ttft: Callable[[CycleState, ReplicaState], float | None] | None = None
    """The price's predicted time to first token of this request on a replica, where the profile's
    picker is the price: the latency objectives judge by it then (one prediction for every choice),
    not by their own estimates. None for a replica priced at the built-in prior alone (nothing
    measured of it: not known)."""


class Filter(Protocol):
    """Drops candidates that must not receive this request, and says why (the decision trace)."""

    name: str

    def filter(self, cycle: CycleState, candidates: list[ReplicaState]) -> list[ReplicaState]:
        """The candidates that remain."""
        ...

    def why(self, state: ReplicaState) -> str:
        """Why ``state`` was removed (asked only for removed replicas, only when tracing)."""
        ...


class Scorer(Protocol):
    """Ranks candidates; every score lies in [0, 1]."""

    name: str

    def score(self, cycle: CycleState, candidates: Sequence[ReplicaState]) -> Mapping[str, float]:
        """A score per candidate name (missing names score 0)."""
        ...


class Picker(Protocol):
    """Orders the candidates by their weighted totals: the first is the choice, the rest fallbacks."""

    name: str

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        """Candidates, best first."""
        ...
