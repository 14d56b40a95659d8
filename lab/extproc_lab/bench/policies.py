"""The policies ``extproc bench routing`` compares, by name.

``extproc`` is our default profile (the router config's ``profile:``), and a variant another
profile of our pipeline; the peers are policy objects of :mod:`extproc_lab.peers`, one per run;
``pooled`` and ``ideal`` are hit-ratio ceilings computed without routing
(:mod:`extproc_lab.sim.ceilings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.api import Config, Profile, build_profile
from extproc_lab import peers
from extproc_lab.peers import CacheProbe, PeerPolicy
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
NO_OBJECTIVES = "extproc_no_slo"
"""Our profile with the requests' latency objectives kept from the router (as a client that sends
none), while the run still judges them: what the objectives change."""
EXTRA = (KV_EVENTS, HOT_KEYS, NO_OBJECTIVES)
KV_EVENTS_DELAY_S = 0.05

GIE_SCRAPE_INTERVAL_S = 0.05
"""GIE's endpoint picker scrapes vLLM's metrics every 50 ms (its documented default)."""

Spec = Callable[[CacheProbe, int, ReplicaProfile], PeerPolicy]
"""A peer's policy object for one run, from the probe of the replicas' caches, the seed and the
replica profile."""


@dataclass(frozen=True)
class PolicyDef:
    """How to build one peer's policy, and the scrape interval its router uses (None: ours)."""

    name: str
    about: str
    spec: Spec
    scrape_interval_s: float | None = None


PEER_DEFS: dict[str, PolicyDef] = {
    d.name: d
    for d in (
        PolicyDef("round_robin", "each request to the next replica", lambda p, s, r: peers.RoundRobin()),
        PolicyDef("random", "a uniform draw (seeded)", lambda p, s, r: peers.RandomChoice(seed=s)),
        PolicyDef("least_request", "fewest in flight, ties at random", lambda p, s, r: peers.LeastRequest(seed=s)),
        PolicyDef(
            "power_of_two",
            "lighter of two random replicas (scraped load)",
            lambda p, s, r: peers.PowerOfTwo(seed=s),
        ),
        PolicyDef(
            "consistent_hash",
            "session key on a 160-vnode ring, no load bound",
            lambda p, s, r: peers.ConsistentHash(),
        ),
        PolicyDef(
            "sglang_cache_aware",
            "sglang-router cache_aware (0.3 / 64 / 1.5)",
            lambda p, s, r: peers.SGLangCacheAware(),
        ),
        PolicyDef(
            "gie_default",
            "GIE: queue 2, kv-cache 2, prefix 3, max score",
            lambda p, s, r: peers.gie_default(seed=s),
            GIE_SCRAPE_INTERVAL_S,
        ),
        PolicyDef(
            "dynamo_kv",
            "Dynamo: min overlap x prefill + decode blocks, KV events",
            lambda p, s, r: peers.DynamoCost(probe=p, num_gpu_blocks=r.num_gpu_blocks, block_size=r.block_size),
        ),
        PolicyDef(
            "llmd_precise",
            "llm-d: precise prefix (KV events) 2, kv-cache 1, queue 1",
            lambda p, s, r: peers.llmd_precise(p, block_size=r.block_size, seed=s),
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
) -> Profile | PeerPolicy:
    """What policy ``name`` routes with: a profile of our pipeline (``extproc``, ``kv_events``, a
    variant), or a new peer policy object for one run (a peer)."""
    if name in (OURS, KV_EVENTS, HOT_KEYS, NO_OBJECTIVES):
        spec: Mapping[str, Any] = config.profile
    elif variants and name in variants:
        spec = variants[name]
    elif name in PEER_DEFS:
        return PEER_DEFS[name].spec(probe, seed, replica)
    else:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(ALL)}")
    return build_profile({**spec, "name": name}, vnodes=config.ring.vnodes, ring_key_blocks=config.ring.key_blocks)


def scrape_interval(name: str) -> float | None:
    """The scrape interval of policy ``name``'s router (None: the router config's)."""
    d = PEER_DEFS.get(name)
    return d.scrape_interval_s if d is not None else None
