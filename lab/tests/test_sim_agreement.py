"""The simulator agrees with the real thing: the same short workload through real Envoy, the
processor and fake HTTP replicas (which run the same replica model in scaled time) and through
the simulator gives prefix-cache hit ratios within a few points."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from extproc.api import Config, CycleState, Profile, ReplicaState
from extproc_lab.bench.policies import policy_profile
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.run import reset_caches
from extproc_lab.replica import PROFILES, REPLICA_HEADER
from extproc_lab.sim.figures import figures
from extproc_lab.sim.generators import multi_turn
from extproc_lab.sim.simulator import SimCacheProbe, Simulation
from extproc_lab.sim.workload import Workload
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
TIME_SCALE = 0.05
SPEC: dict[str, Any] = {
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 8, "max": 8},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "uniform", "min": 800, "max": 1500},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 8, "max": 16}},
}


def workload() -> Workload:
    """16 conversations of 4 turns, two new ones a (profile) second, no think time: on 4 demo
    replicas (16k tokens each) round robin evicts, sticky routing does not."""
    return multi_turn(16, seed=5, conversations_per_s=2.0, think_s=0.0, spec=SPEC)


@pytest.fixture(scope="module")
def gateway() -> Iterator[LocalGateway]:
    require_binary("envoy")
    with LocalGateway(replicas=4, time_scale=TIME_SCALE) as gw:
        yield gw


async def replay(base_url: str, wl: Workload) -> tuple[float, dict[str, str]]:
    """Each conversation's turns in order, conversations started at their (scaled) arrival times;
    returns the token hit ratio the replicas reported and which replica served each request."""
    totals = [0, 0]
    served: dict[str, str] = {}
    followers = wl.followers()

    async def conversation(http: aiohttp.ClientSession, first: int) -> None:
        # real time: the workload's arrivals against real processes
        await asyncio.sleep(wl.requests[first].arrival_s * TIME_SCALE)
        index: int | None = first
        while index is not None:
            req = wl.requests[index]
            headers = {k: v for k, v in req.headers().items() if not k.startswith(":")}
            async with http.post(f"{base_url}/v1/chat/completions", data=json.dumps(req.body()), headers=headers) as r:
                assert r.status == 200
                served[req.request_id] = r.headers[REPLICA_HEADER]
                usage = (await r.json())["usage"]
            totals[0] += usage["prompt_tokens"]
            totals[1] += usage["prompt_tokens_details"]["cached_tokens"]
            nxt = followers.get(index, [])
            index = nxt[0] if nxt else None

    async with aiohttp.ClientSession(headers={"content-type": "application/json"}) as http:
        await asyncio.gather(*(conversation(http, r.index) for r in wl.requests if r.after < 0))
    return totals[1] / totals[0], served


@dataclass
class ReplayPicker:
    """Sends each request where the real run sent it."""

    served: dict[str, str]
    name: str = "replay"

    def pick(
        self, cycle: CycleState, candidates: Sequence[ReplicaState], totals: Mapping[str, float]
    ) -> list[ReplicaState]:
        target = self.served[cycle.features.request_id]
        return sorted(candidates, key=lambda c: c.name != target)

    def forget(self, replica: str) -> None:
        pass


def simulated(wl: Workload, make_profile: Callable[[SimCacheProbe], Profile]) -> float:
    sim = Simulation(wl, PROFILES["demo"], 4, make_profile, config=Config())
    return float(figures(sim.run())["hit_ratio"])


async def test_our_routing_gives_the_same_hit_ratio_through_envoy_and_in_the_simulator(gateway: LocalGateway) -> None:
    reset_caches(gateway)
    real, _ = await replay(gateway.url, workload())
    demo, cfg = PROFILES["demo"], Config()
    sim = simulated(workload(), lambda probe: policy_profile("extproc", probe, 7, demo, cfg))
    assert real > 0.7
    assert abs(real - sim) <= 0.03, (real, sim)


async def test_the_replica_model_agrees_on_envoys_round_robin_placement(gateway: LocalGateway) -> None:
    # Envoy's own round robin, with the evictions it causes; the simulator then sends every
    # request where Envoy did, so only the replica model (cache, eviction, timing) is compared.
    reset_caches(gateway)
    real, served = await replay(gateway.round_robin_url, workload())
    assert len(set(served.values())) == 4
    profile = Profile(filters=[], scorers=[], picker=ReplayPicker(served), name="replay")
    sim = simulated(workload(), lambda probe: profile)
    assert real < 0.6  # round robin scatters conversations: the caches are under pressure
    assert abs(real - sim) <= 0.03, (real, sim)
