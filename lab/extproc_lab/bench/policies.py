"""The policies ``extproc bench routing`` compares, by name, as profiles of our pipeline.

``extproc`` is our default profile (the router config's ``profile:``); the peers are built from
the plugins of :mod:`extproc_lab.peers`; ``pooled`` and ``ideal`` are hit-ratio ceilings
computed without routing (:mod:`extproc_lab.sim.ceilings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.config import Config
from extproc.routing.pipeline import Profile
from extproc.routing.registry import build_profile
from extproc_lab.peers import PEER_REGISTRY, CacheProbe
from extproc_lab.replica.timing import ReplicaProfile

OURS = "extproc"
PEERS = (
    "round_robin",
    "random",
    "least_request",
    "power_of_two",
    "consistent_hash",
    "sglang_cache_aware",
    "gie_default",
    "dynamo_kv",
    "llmd_precise",
)
CEILINGS = ("pooled", "ideal")
ALL = (OURS, *PEERS, *CEILINGS)
KV_EVENTS = "kv_events"
"""Our profile with vLLM's KV events as the cache state (a tokenizer per model): asked by name."""
HOT_KEYS = "hot_keys"
"""Our profile with the router config's ``hot_keys:`` switched on (its other values as configured)."""
EXTRA = (KV_EVENTS, HOT_KEYS)
KV_EVENTS_DELAY_S = 0.05

GIE_SCRAPE_INTERVAL_S = 0.05
"""GIE's endpoint picker scrapes vLLM's metrics every 50 ms (its documented default)."""

Spec = Callable[[CacheProbe, int, ReplicaProfile], Mapping[str, Any]]


def _picker(kind: str, **parameters: Any) -> dict[str, Any]:
    return {"filters": [], "scorers": [], "picker": {"type": kind, "parameters": parameters}}


@dataclass(frozen=True)
class PolicyDef:
    """How to build one policy's profile, and the scrape interval its router uses (None: ours)."""

    name: str
    about: str
    spec: Spec
    scrape_interval_s: float | None = None


PEER_DEFS: dict[str, PolicyDef] = {
    d.name: d
    for d in (
        PolicyDef("round_robin", "each request to the next replica", lambda p, s, r: _picker("round_robin")),
        PolicyDef("random", "a uniform draw (seeded)", lambda p, s, r: _picker("random", seed=s)),
        PolicyDef(
            "least_request", "fewest in flight, ties at random", lambda p, s, r: _picker("least_request", seed=s)
        ),
        PolicyDef(
            "power_of_two",
            "lighter of two random replicas (scraped load)",
            lambda p, s, r: _picker("power_of_two", seed=s),
        ),
        PolicyDef(
            "consistent_hash",
            "session key on a 160-vnode ring, no load bound",
            lambda p, s, r: _picker("consistent_hash"),
        ),
        PolicyDef(
            "sglang_cache_aware",
            "sglang-router cache_aware (0.3 / 64 / 1.5)",
            lambda p, s, r: _picker("sglang_cache_aware"),
        ),
        PolicyDef(
            "gie_default",
            "GIE: queue 2, kv-cache 2, prefix 3, max score",
            lambda p, s, r: {
                "filters": [],
                "scorers": [
                    {"type": "gie_queue", "weight": 2},
                    {"type": "gie_kv_cache", "weight": 2},
                    {"type": "gie_prefix", "weight": 3},
                ],
                "picker": {"type": "gie_max_score", "parameters": {"seed": s}},
            },
            GIE_SCRAPE_INTERVAL_S,
        ),
        PolicyDef(
            "dynamo_kv",
            "Dynamo: min overlap x prefill + decode blocks, KV events",
            lambda p, s, r: _picker("dynamo_kv", probe=p, num_gpu_blocks=r.num_gpu_blocks, block_size=r.block_size),
        ),
        PolicyDef(
            "llmd_precise",
            "llm-d: precise prefix (KV events) 2, kv-cache 1, queue 1",
            lambda p, s, r: {
                "filters": [],
                "scorers": [
                    {
                        "type": "llmd_precise_prefix",
                        "weight": 2,
                        "parameters": {"probe": p, "block_size": r.block_size},
                    },
                    {"type": "gie_kv_cache", "weight": 1},
                    {"type": "gie_queue", "weight": 1},
                ],
                "picker": {"type": "gie_max_score", "parameters": {"seed": s}},
            },
            GIE_SCRAPE_INTERVAL_S,
        ),
    )
}


def policy_profile(
    name: str,
    probe: CacheProbe,
    seed: int,
    replica: ReplicaProfile,
    config: Config,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
) -> Profile:
    """The routing profile of policy ``name`` (``extproc``, a peer, or a variant's profile)."""
    if name in (OURS, KV_EVENTS, HOT_KEYS):
        spec: Mapping[str, Any] = config.profile
    elif variants and name in variants:
        spec = variants[name]
    elif name in PEER_DEFS:
        spec = PEER_DEFS[name].spec(probe, seed, replica)
    else:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(ALL)}")
    return build_profile(
        {**spec, "name": name}, registry=PEER_REGISTRY, vnodes=config.vnodes, ring_key_blocks=config.ring_key_blocks
    )


def scrape_interval(name: str) -> float | None:
    """The scrape interval of policy ``name``'s router (None: the router config's)."""
    d = PEER_DEFS.get(name)
    return d.scrape_interval_s if d is not None else None
