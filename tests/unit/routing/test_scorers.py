"""Every registered scorer keeps its own output in [0, 1] (the contract of
:class:`~extproc.routing.plugins.Scorer`), for any candidates, affinity view, request and
parameters a config may give: read from the scorer itself, not after the pipeline's clamp."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.features import RequestFeatures
from extproc.routing import AffinityView, HashRing, Replica, ReplicaState, Snapshot
from extproc.routing.plugins import CycleState, Scorer
from extproc.routing.registry import REGISTRY

NAMES = [f"r{i}" for i in range(8)]
ADAPTERS = ["base", "ad-1", "ad-2", "ad-3"]
counts = st.integers(0, 10_000)
fractions = st.floats(0.0, 1.0)
adapter_sets = st.frozensets(st.sampled_from(ADAPTERS), max_size=3)


@st.composite
def replica_states(draw: st.DrawFn, name: str) -> ReplicaState:
    return ReplicaState(
        Replica(name, f"10.0.0.{NAMES.index(name) + 1}:8000", weight=draw(st.floats(0.1, 4.0))),
        in_rotation=draw(st.booleans()),
        health=draw(fractions),
        inflight=draw(st.integers(0, 200)),
        inflight_tokens=draw(st.integers(0, 2_000_000)),
        pending_prefill_tokens=draw(st.integers(0, 2_000_000)),
        recent_requests=draw(st.floats(0.0, 1e5)),
        queue=draw(st.integers(0, 500)),
        running=draw(st.integers(0, 500)),
        kv_usage=draw(st.floats(-0.5, 2.0)),  # a scrape may say anything: the scorers bound it
        kv_capacity_tokens=draw(st.sampled_from([0, 1, 4096, 1_000_000])),
        cache_fill=draw(fractions),
        working_set_tokens=draw(st.integers(0, 2_000_000)),
        adapters=draw(adapter_sets),
        adapters_waiting=draw(adapter_sets),
        max_lora=draw(st.integers(0, 4)),
        models=draw(adapter_sets),
    )


@st.composite
def cycles(draw: st.DrawFn) -> tuple[CycleState, list[ReplicaState]]:
    """One decision's inputs: the candidates (the snapshot's members that passed the filters), the
    view (matches may name replicas that are not candidates, and exceed the request's blocks), the
    request, and what the filters found (the hot prefix's set, the overloaded replicas)."""
    members = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    states = [draw(replica_states(name)) for name in members]
    candidates = draw(st.lists(st.sampled_from(states), unique_by=lambda s: s.name)) if states else []
    blocks = draw(st.integers(0, 64))
    tenant = draw(st.sampled_from(["", "acme", "noisy"]))
    features = RequestFeatures(
        path="/v1/chat/completions",
        model=draw(st.sampled_from(["", *ADAPTERS, "other"])),
        session_key=draw(st.one_of(st.none(), st.text(max_size=4))),
        tenant=tenant,
        prompt_chars=draw(st.integers(0, 400_000)),
        prefix_hashes=tuple(range(blocks)),
        prompt_tokens=draw(st.integers(0, 100_000)),
    )
    view = AffinityView(
        pinned=draw(st.one_of(st.none(), st.sampled_from([*NAMES, "gone"]))),
        prefix_matches=draw(st.dictionaries(st.sampled_from(NAMES), st.integers(0, 2 * blocks + 2))),
        pin_lost=draw(st.sampled_from([None, "kv_events", "hit_counters", "capacity"])),
    )
    tenant_inflight = draw(
        st.dictionaries(st.tuples(st.sampled_from(["acme", "noisy"]), st.sampled_from(NAMES)), counts)
    )
    snapshot = Snapshot(tuple(states), tenant_inflight=tenant_inflight)
    cycle = CycleState(
        features=features,
        snapshot=snapshot,
        view=view,
        now=draw(st.floats(0.0, 1e9)),
        ring=HashRing([(s.name, s.replica.weight) for s in states]),
        ring_key=draw(st.one_of(st.none(), st.text(max_size=8), st.integers(0, 2**64 - 1))),
        hot_key=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        hot_replicas=draw(st.integers(0, 4)),
        overloaded=draw(st.frozensets(st.sampled_from(NAMES))),
        hot_set=draw(st.one_of(st.none(), st.frozensets(st.sampled_from(NAMES)))),
    )
    return cycle, candidates


# The parameters a profile may give each scorer, within what they mean (weights and floors >= 0).
weights = st.floats(0.0, 10.0)
floors = st.integers(0, 100_000)
PARAMETERS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "session_affinity": st.fixed_dictionaries({"by_cache": st.booleans(), "floor": fractions}),
    "prefix": st.just({}),
    "load": st.fixed_dictionaries(
        {
            "work_weight": weights,
            "recent_weight": weights,
            "kv_weight": weights,
            "tokens_per_request": st.integers(0, 4096),
            "floor_tokens": floors,
            "floor_requests": st.floats(0.0, 100.0),
        }
    ),
    "ring": st.fixed_dictionaries({"load_factor": st.floats(1.0, 4.0)}),
    "tenant_headroom": st.fixed_dictionaries({"per_replica": st.integers(0, 64)}),
    "lora": st.just({}),
    "prefill_cost": st.fixed_dictionaries(
        {
            "floor_tokens": floors,
            "kv_weight": st.floats(0.0, 2.0),
            "overflow_weight": st.floats(0.0, 2.0),
            "working_set_weight": st.floats(0.0, 2.0),
        }
    ),
    # Its range with objectives and warm models drawn is tests/unit/routing/test_latency.py's own property test.
    "slo_headroom": st.just({}),
    "hot_prefix": st.fixed_dictionaries(
        {"tokens_per_request": st.integers(0, 4096), "floor_tokens": floors, "count_uncached": st.booleans()}
    ),
    "price": st.fixed_dictionaries(
        {
            "output_tokens": st.integers(1, 4096),
            "others_weight": st.floats(0.0, 2.0),
            "session_tokens": st.integers(0, 4096),
            "hysteresis": st.floats(0.0, 2.0),
            "hysteresis_s": st.floats(0.0, 1.0),
            "turn_tokens": st.integers(0, 4096),
            "evict_weight": st.floats(0.0, 4.0),
            "working_set_weight": st.floats(0.0, 2.0),
            "floor_s": st.floats(0.0, 1.0),
        }
    ),
}


def test_every_registered_scorer_is_covered() -> None:
    assert set(PARAMETERS) == set(REGISTRY.scorers)


def in_range(scorer: Scorer, cycle: CycleState, candidates: list[ReplicaState]) -> None:
    scores = scorer.score(cycle, candidates)
    bad = {name: s for name, s in scores.items() if not (math.isfinite(s) and 0.0 <= s <= 1.0)}
    assert not bad, (scorer, bad)


@pytest.mark.parametrize("kind", sorted(REGISTRY.scorers))
@settings(max_examples=150)
@given(data=st.data())
def test_a_scorer_scores_in_the_unit_interval(kind: str, data: st.DataObject) -> None:
    factory: Callable[..., Scorer] = REGISTRY.scorers[kind]
    cycle, candidates = data.draw(cycles())
    in_range(factory(), cycle, candidates)  # the defaults
    in_range(factory(**data.draw(PARAMETERS[kind])), cycle, candidates)
