"""Replicas that die and come back, through real Envoy, the processor and fake replicas."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import page_shows, turn, wait_for

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
FAST_HEALTH = "health:\n  cooldown_s: 1.0\n"


@pytest.mark.parametrize("mode", ["cluster", "endpoint"])
async def test_killing_a_replica_mid_replay_costs_no_client_error(mode: str, tmp_path: Path) -> None:
    require_binary("envoy")
    config = tmp_path / "router.yaml"
    config.write_text(FAST_HEALTH)
    with LocalGateway(replicas=3, mode=mode, time_scale=0.05, processor_args=("--config", str(config))) as gw:
        histories = {f"s{i}": f"conversation {i} " + "background text " * 150 for i in range(9)}
        log: dict[str, list[tuple[int, str, int, float]]] = defaultdict(list)
        killed: list[float] = []
        loop = asyncio.get_running_loop()

        async def converse(http: aiohttp.ClientSession, session: str, turns: int, phase: str) -> None:
            for t in range(turns):
                histories[session] += f" turn {phase}{t} question and answer"
                started = loop.time()
                status, replica, cached = await turn(http, gw.url, session, histories[session])
                log[session].append((status, replica, cached, started))
                await asyncio.sleep(0.05)  # a user reading the answer

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(converse(http, s, 4, "before") for s in histories))
            holders = Counter(log[s][-1][1] for s in histories)
            victim = holders.most_common(1)[0][0]

            async def kill_soon() -> None:
                await asyncio.sleep(0.3)  # real time: the kill lands mid-conversation
                gw.procs.kill(victim)
                killed.append(loop.time())

            await asyncio.gather(kill_soon(), *(converse(http, s, 40, "during") for s in histories))
            assert killed
            errors = [(s, e) for s, entries in log.items() for e in entries if e[0] != 200]
            assert errors == []  # no client saw the replica die
            for s in histories:
                after = [e for e in log[s] if e[3] > killed[0] + 1.0]  # once the router has noticed
                assert len(after) >= 3
                assert victim not in {e[1] for e in after}
                assert len({e[1] for e in after}) == 1, log[s]  # re-pinned, and sticky again
                assert after[-1][2] > 0  # the new replica's cache serves the following turns

            victim_replica = next(r for r in gw.members if r.name == victim)
            gw.start_replica(victim_replica)
            back = f'extproc_replica_in_rotation{{replica="{victim}"}} 1.0'  # cooldown, then two good scrapes
            await wait_for(lambda: page_shows(http, gw.metrics_url, back), back, within_s=15.0, step_s=0.1)
            fresh = await asyncio.gather(*(turn(http, gw.url, f"fresh-{i}", f"new topic {i} " * 60) for i in range(24)))
            assert all(status == 200 for status, _, _ in fresh)
            assert victim in {replica for _, replica, _ in fresh}  # back in rotation, taking new sessions
