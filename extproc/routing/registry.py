"""Plugins by name, and profiles assembled from the config's ``profile:`` section.

The one place that knows every plugin type: a new plugin is registered here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from extproc.routing.candidates import CANDIDATE_SCORERS
from extproc.routing.peers import PEER_PICKERS, PEER_SCORERS
from extproc.routing.pipeline import Profile, WeightedScorer
from extproc.routing.plugins import (
    Filter,
    InRotationFilter,
    LoadScorer,
    LoraFilter,
    LoraScorer,
    MaxScorePicker,
    OverloadFilter,
    Picker,
    PoolFilter,
    PrefillCostScorer,
    PrefixScorer,
    RingScorer,
    Scorer,
    SessionAffinityScorer,
    TenantHeadroomScorer,
    TenantShardFilter,
)

FILTERS: dict[str, Callable[..., Filter]] = {
    "in_rotation": InRotationFilter,
    "overload": OverloadFilter,
    "pool": PoolFilter,
    "tenant_shard": TenantShardFilter,
    "lora": LoraFilter,
}
SCORERS: dict[str, Callable[..., Scorer]] = {
    "session_affinity": SessionAffinityScorer,
    "prefix": PrefixScorer,
    "load": LoadScorer,
    "ring": RingScorer,
    "tenant_headroom": TenantHeadroomScorer,
    "lora": LoraScorer,
    "prefill_cost": PrefillCostScorer,
}
PICKERS: dict[str, Callable[..., Picker]] = {
    "max_score": MaxScorePicker,
}
# Other routers' policies (extproc/routing/peers.py), for the routing benchmark and for trying
# them behind Envoy: round_robin, random, least_request, power_of_two, consistent_hash,
# sglang_cache_aware, gie_*, dynamo_kv, oracle.
SCORERS.update(PEER_SCORERS)
PICKERS.update(PEER_PICKERS)
# Scorers proposed for the default profile (extproc/routing/candidates.py), unused unless named.
SCORERS.update(CANDIDATE_SCORERS)

# Weights: a live pin outweighs everything else together, as far as the cache behind it is
# still believed held (``by_cache``: under KV pressure a pin whose conversation was evicted is
# worth no more than any other replica, and placement falls to cost and load). Prefix overlap and
# load are weighed in one unit by the prefill-cost scorer (work already sent there plus the part
# of this prompt it does not hold), so a shared prefix attracts new work only until the queue
# behind it costs more than prefilling elsewhere. (Its ``kv_weight`` and ``overflow_weight``,
# which also count the KV held there, are off: in the KV-pressure sweep they spread shared-prefix
# groups, 29% against 36% hit ratio at 6,000 blocks, and gained nothing on multi-turn.) The
# prefix scorer adds a preference for deep matches on top, and the load scorer a preference for
# replicas with fewer sessions and free KV cache. The ring only breaks ties (weight 0.1: more
# overrode real load differences in the simulator), which keeps gateways without shared state in
# agreement on an idle fleet. Overload is a filter, not a weight: no amount of affinity pushes a
# replica that is out of KV blocks (judged on the fresher of the last scrape and what the router
# sent since). Tuned with `extproc bench routing` (benchmarks/routing.md, including its
# KV-pressure sweep).
DEFAULT_PROFILE: dict[str, Any] = {
    "filters": [
        {"type": "pool"},
        {"type": "tenant_shard"},
        {"type": "in_rotation"},
        {"type": "lora"},
        {"type": "overload"},
    ],
    "scorers": [
        {"type": "session_affinity", "weight": 10, "parameters": {"by_cache": True}},
        {"type": "prefix", "weight": 2},
        {"type": "prefill_cost", "weight": 3},
        {"type": "load", "weight": 2},
        {"type": "ring", "weight": 0.1},
        {"type": "lora", "weight": 3},
        {"type": "tenant_headroom", "weight": 3},
    ],
    "picker": {"type": "max_score"},
}


class ProfileError(ValueError):
    """A profile in the config names an unknown plugin or gives it bad parameters."""


def _make(kind: str, table: Mapping[str, Callable[..., Any]], spec: Mapping[str, Any], where: str) -> Any:
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ProfileError(f"{where}: expected a mapping with 'type'")
    factory = table.get(spec["type"])
    if factory is None:
        raise ProfileError(f"{where}: unknown {kind} {spec['type']!r} (known: {', '.join(sorted(table))})")
    params = spec.get("parameters") or {}
    try:
        return factory(**params)
    except TypeError as exc:
        raise ProfileError(f"{where}: bad parameters for {spec['type']!r}: {exc}") from None


def build_profile(spec: Mapping[str, Any] | None = None, **ring: Any) -> Profile:
    """Build a :class:`Profile` from a config mapping (``DEFAULT_PROFILE`` when None)."""
    spec = DEFAULT_PROFILE if spec is None else spec
    filters: Sequence[Mapping[str, Any]] = spec.get("filters", DEFAULT_PROFILE["filters"])
    scorers: Sequence[Mapping[str, Any]] = spec.get("scorers", DEFAULT_PROFILE["scorers"])
    picker: Mapping[str, Any] = spec.get("picker", DEFAULT_PROFILE["picker"])
    weighted = []
    for i, s in enumerate(scorers):
        weight = s.get("weight", 1) if isinstance(s, Mapping) else 1
        if not isinstance(weight, int | float) or weight < 0:
            raise ProfileError(f"profile.scorers[{i}].weight: expected a number >= 0")
        weighted.append(WeightedScorer(_make("scorer", SCORERS, s, f"profile.scorers[{i}]"), float(weight)))
    return Profile(
        filters=[_make("filter", FILTERS, f, f"profile.filters[{i}]") for i, f in enumerate(filters)],
        scorers=weighted,
        picker=_make("picker", PICKERS, picker, "profile.picker"),
        name=str(spec.get("name", "default")),
        **ring,
    )
