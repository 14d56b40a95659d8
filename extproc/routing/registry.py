"""Plugins by name, and profiles assembled from the config's ``profile:`` section.

:data:`REGISTRY` holds the router's own plugins: a new production plugin is registered there and
nowhere else. The lab's peer routers are not plugins: each is a simulation policy that decides in
place of the pipeline (:class:`~extproc.routing.pipeline.Decider`, ``extproc_lab.peers``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extproc.base.validation import describe
from extproc.routing.hot import HotPrefixFilter, HotPrefixScorer
from extproc.routing.price import PricePicker, PriceScorer
from extproc.routing.profile import Profile, WeightedScorer
from extproc.routing.slo import SloFilter, SloHeadroomScorer

if TYPE_CHECKING:
    from pydantic import BaseModel
from extproc.routing.filters import InRotationFilter, OverloadFilter, PoolFilter, TenantShardFilter
from extproc.routing.lora import LoraFilter, LoraScorer
from extproc.routing.pickers import MaxScorePicker, RoundRobinPicker
from extproc.routing.plugins import Filter, Picker, Scorer
from extproc.routing.scorers import (
    LoadScorer,
    PrefillCostScorer,
    PrefixScorer,
    RingScorer,
    SessionAffinityScorer,
    TenantHeadroomScorer,
)


@dataclass(frozen=True)
class PluginRegistry:
    """Filter, scorer and picker factories by the ``type:`` a profile names them with."""

    filters: Mapping[str, Callable[..., Filter]] = field(default_factory=dict)
    scorers: Mapping[str, Callable[..., Scorer]] = field(default_factory=dict)
    pickers: Mapping[str, Callable[..., Picker]] = field(default_factory=dict)


REGISTRY = PluginRegistry(
    filters={
        "in_rotation": InRotationFilter,
        "overload": OverloadFilter,
        "pool": PoolFilter,
        "tenant_shard": TenantShardFilter,
        "lora": LoraFilter,
        "hot_prefix": HotPrefixFilter,
        "slo": SloFilter,
    },
    scorers={
        "session_affinity": SessionAffinityScorer,
        "prefix": PrefixScorer,
        "load": LoadScorer,
        "ring": RingScorer,
        "tenant_headroom": TenantHeadroomScorer,
        "lora": LoraScorer,
        "prefill_cost": PrefillCostScorer,
        "hot_prefix": HotPrefixScorer,
        "slo_headroom": SloHeadroomScorer,
        "price": PriceScorer,
    },
    pickers={"max_score": MaxScorePicker, "price": PricePicker, "in_turn": RoundRobinPicker},
)
"""The router's own plugins: what a config file may name."""

# The scores profile, the default.
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
# KV-pressure sweep). The hot-prefix filter and scorer act only on prefixes the hot-key detector
# (``hot_keys:``, off by default) reports hot: they keep such a prefix's k replicas and prefer the
# least loaded of them. The latency-objective filter and scorer act only on requests that carry
# objectives (``x-slo-ttft-ms``, ``x-slo-tpot-ms``) and only on replicas whose latency model is
# warm: they drop candidates predicted to miss, and headroom weighs 1, less than a pin or a deep
# prefix match, so it decides among replicas the cache leaves about tied.
SCORES_PROFILE: dict[str, Any] = {
    "filters": [
        {"type": "pool"},
        {"type": "tenant_shard"},
        {"type": "in_rotation"},
        {"type": "lora"},
        {"type": "overload"},
        {"type": "hot_prefix"},
        {"type": "slo"},
    ],
    "scorers": [
        {"type": "session_affinity", "weight": 10},
        {"type": "prefix", "weight": 2},
        {"type": "prefill_cost", "weight": 3},
        {"type": "load", "weight": 2},
        {"type": "ring", "weight": 0.1},
        {"type": "lora", "weight": 3},
        {"type": "tenant_headroom", "weight": 3},
        {"type": "hot_prefix", "weight": 5},
        {"type": "slo_headroom", "weight": 1},
    ],
    "picker": {"type": "max_score"},
}


# The price profile (:mod:`extproc.routing.price`): one price in seconds per candidate decides;
# filters keep only what is binary (pool, tenant shard, rotation, LoRA slots, a hot prefix's set,
# a latency objective predicted missed); no overload threshold (the price's KV wait and queue
# take its place) and no affinity or load scorers (staying is cheap because the history is
# cached). The scorers left only break what the price leaves about tied, each point worth the
# picker's ``seconds_per_point`` (1 ms): the ring keeps gateways in agreement on an idle fleet.
PRICE_PROFILE: dict[str, Any] = {
    "filters": [
        {"type": "pool"},
        {"type": "tenant_shard"},
        {"type": "in_rotation"},
        {"type": "lora"},
        {"type": "hot_prefix"},
        {"type": "slo"},
    ],
    "scorers": [
        {"type": "ring", "weight": 0.1},
        {"type": "lora", "weight": 3},
        {"type": "tenant_headroom", "weight": 3},
        {"type": "hot_prefix", "weight": 5},
        {"type": "slo_headroom", "weight": 1},
    ],
    "picker": {"type": "price"},
}


DEFAULT_PROFILE: dict[str, Any] = SCORES_PROFILE
"""The shipped profile: the scores profile. The price (:data:`PRICE_PROFILE`) is not the default:
on real vLLM engines at twice the fleet's KV the scores profile found as much in cache or a
little more (2.5 points on average over twenty pairs, the price ahead in seven;
benchmarks/price.md), though the price passes the end-to-end suite as the default and matches it
in the simulator; where they disagree, the real engines decide."""


class ProfileError(ValueError):
    """A profile in the config names an unknown plugin or gives it bad parameters."""


@functools.cache
def _parameters_model(factory: Callable[..., Any]) -> type[BaseModel] | None:
    """A strict model of a dataclass plugin's fields, to check ``parameters`` before building it."""
    if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
        return None
    # Imported here: a profile without parameters (the default one) is built without pydantic.
    from pydantic import ConfigDict, Field, create_model

    try:
        hints = typing.get_type_hints(factory)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(factory):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                fields[f.name] = (hints[f.name], f.default)
            elif f.default_factory is not dataclasses.MISSING:
                fields[f.name] = (hints[f.name], Field(default_factory=f.default_factory))
            else:
                fields[f.name] = (hints[f.name], ...)
        config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)
        return create_model(f"{factory.__name__}Parameters", __config__=config, **fields)
    except Exception:  # a field type pydantic cannot check (a protocol): the factory checks itself
        return None


def _make(kind: str, table: Mapping[str, Callable[..., Any]], spec: Mapping[str, Any], where: str) -> Any:
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ProfileError(f"{where}: expected a mapping with 'type'")
    factory = table.get(spec["type"])
    if factory is None:
        raise ProfileError(f"{where}: unknown {kind} {spec['type']!r} (known: {', '.join(sorted(table))})")
    params = spec.get("parameters") or {}
    model = _parameters_model(factory) if params else None
    if model is not None:
        from pydantic import ValidationError

        try:
            model.model_validate(params)
        except ValidationError as exc:
            detail = describe(
                exc, prefix=f"{where}.parameters", unknown="unknown parameter", suffix=f" ({spec['type']!r})"
            )
            raise ProfileError(detail) from None
    try:
        return factory(**params)
    except (TypeError, ValueError) as exc:  # a missing argument, or a plugin's own check
        raise ProfileError(f"{where}: bad parameters for {spec['type']!r}: {exc}") from None


def build_profile(
    spec: Mapping[str, Any] | None = None, *, registry: PluginRegistry = REGISTRY, **ring: Any
) -> Profile:
    """Build a :class:`Profile` from a config mapping (``DEFAULT_PROFILE`` when None), its plugins
    taken from ``registry``."""
    spec = DEFAULT_PROFILE if spec is None else spec
    filters: Sequence[Mapping[str, Any]] = spec.get("filters", DEFAULT_PROFILE["filters"])
    scorers: Sequence[Mapping[str, Any]] = spec.get("scorers", DEFAULT_PROFILE["scorers"])
    picker: Mapping[str, Any] = spec.get("picker", DEFAULT_PROFILE["picker"])
    weighted = []
    for i, s in enumerate(scorers):
        weight = s.get("weight", 1) if isinstance(s, Mapping) else 1
        if not isinstance(weight, int | float) or weight < 0:
            raise ProfileError(f"profile.scorers[{i}].weight: expected a number >= 0")
        weighted.append(WeightedScorer(_make("scorer", registry.scorers, s, f"profile.scorers[{i}]"), float(weight)))
    return Profile(
        filters=[_make("filter", registry.filters, f, f"profile.filters[{i}]") for i, f in enumerate(filters)],
        scorers=weighted,
        picker=_make("picker", registry.pickers, picker, "profile.picker"),
        name=str(spec.get("name", "default")),
        **ring,
    )
