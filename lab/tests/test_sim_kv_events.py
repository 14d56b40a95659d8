"""The simulator's kv_events policy: the replica models' stores and evictions reach the router's
event index after a delay, and routing reads them."""

from __future__ import annotations

from dataclasses import replace

from extproc.api import Config
from extproc_lab.bench.policies import KV_EVENTS, policy_profile
from extproc_lab.bench.workloads import WorkloadSpec
from extproc_lab.replica.timing import PROFILES
from extproc_lab.sim.figures import figures
from extproc_lab.sim.simulator import Simulation

LLAMA = PROFILES["llama-8b-h100"]
SMALL = WorkloadSpec("multi-turn", rate=1.0, seed=3, limit=250)


def simulate(blocks: int, delay_s: float | None = 0.05) -> Simulation:
    cfg = Config()
    profile = replace(LLAMA, num_gpu_blocks=blocks)
    return Simulation(
        SMALL.build(),
        profile,
        4,
        lambda probe: policy_profile(KV_EVENTS, probe, 7, profile, cfg),
        policy=KV_EVENTS,
        config=cfg,
        kv_events_delay_s=delay_s,
    )


def test_the_index_ends_equal_to_the_replicas_caches() -> None:
    sim = simulate(blocks=600)  # small caches: evictions happen
    run = sim.run()
    assert figures(run)["requests"] == 250
    assert sim.kv_feed is not None
    sim.kv_feed.deliver(float("inf"))
    index = sim.kv_feed.state.source.index.model("")
    for name, model in zip(sim.names, sim.models, strict=True):
        held = set(model.pool._refs)
        assert index.blocks(name) == len(held)
        assert all(index.matches([k], 1e9, [name]) == {name: 1.0} for k in list(held)[:50])


def test_kv_events_routing_finds_cached_prefixes() -> None:
    run = simulate(blocks=3000).run()
    f = figures(run)
    assert f["decisions"].get("prefix", 0) + f["decisions"].get("sticky", 0) > 0
    assert f["hit_ratio"] > 0.5
