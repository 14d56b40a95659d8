"""Through real Envoy, to backends that are not our fake replica: vLLM's own /metrics page whose
prefix-cache counters never move. Sessions stay on their replica while none is overloaded (a
counter that does not move is no evidence of eviction); when one replica reports a long queue
and a full KV cache, its sessions spill over and every other session stays."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest

from extproc.routing.model import Replica
from extproc_lab.demo.fault_matrix import with_config
from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import ROOT, require_binary
from tests.helpers import page_shows, turn, wait_for

pytestmark = pytest.mark.e2e
BACKEND = ROOT / "tests" / "backends" / "frozen_vllm.py"
CONFIG = "health:\n  scrape_interval_s: 0.2\n  cooldown_s: 1.0\n"
CONVERSATIONS, TURNS = 24, 8


class FrozenGateway(LocalGateway):
    """A :class:`LocalGateway` whose replicas are :mod:`tests.backends.frozen_vllm`."""

    def replica_argv(self, replica: Replica) -> list[str]:
        port = replica.address.rpartition(":")[2]
        return [sys.executable, str(BACKEND), "--name", replica.name, "--port", port, "--flags", str(self.dir)]


async def test_sessions_stay_when_prefix_counters_never_move(tmp_path: Path) -> None:
    require_binary("envoy")
    gw = with_config(FrozenGateway(replicas=4, log_dir=tmp_path), CONFIG)
    histories = {f"s{i}": f"conversation {i} " + "background text " * 800 for i in range(CONVERSATIONS)}

    async def round_of_turns(http: aiohttp.ClientSession, tag: str) -> dict[str, str]:
        async def one(session: str) -> tuple[str, str]:
            histories[session] += f" turn {tag}: a question and its answer " * 10
            status, replica, _ = await turn(http, gw.url, session, histories[session], model="m")
            assert status == 200, status
            return session, replica

        return dict(await asyncio.gather(*(one(s) for s in histories)))

    with gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            line = 'extproc_replica_queue_requests{replica="replica-3"} 3.0'
            await wait_for(lambda: page_shows(http, gw.metrics_url, line), line, within_s=10.0, step_s=0.1)
            first = await round_of_turns(http, "0")
            assert len(set(first.values())) > 1  # spread over the fleet
            moved = 0
            for t in range(1, TURNS):
                placement = await round_of_turns(http, str(t))
                moved += sum(placement[s] != first[s] for s in first)
                await asyncio.sleep(0.3)  # scrapes in between: frozen counters, claims sent
            assert moved == 0, f"{moved} of {(TURNS - 1) * CONVERSATIONS} follow-up turns left their replica"

            victim = max(set(first.values()), key=list(first.values()).count)
            (tmp_path / f"{victim}.overloaded").touch()
            line = f'extproc_replica_queue_requests{{replica="{victim}"}} 50.0'
            await wait_for(lambda: page_shows(http, gw.metrics_url, line), line, within_s=10.0, step_s=0.1)
            placement = await round_of_turns(http, "busy")
            theirs = {s for s, r in first.items() if r == victim}
            assert all(placement[s] != victim for s in theirs)  # spilled over
            assert all(placement[s] == first[s] for s in first if s not in theirs)  # the others stayed
