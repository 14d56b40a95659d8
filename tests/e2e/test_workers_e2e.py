"""``extproc serve --workers 2`` through real Envoy: two processes on one ext_proc port, sharing
pins, the prefix index and in-flight load in memory, so a conversation stays on its replica
whichever worker each of its turns reaches."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn
from tests.conftest import require_binary
from tests.helpers import decisions, send_turn

pytestmark = pytest.mark.e2e
CONVERSATIONS, TURNS = 20, 4


@pytest.mark.parametrize("server", ["grpcio", "grpclib"])
async def test_two_workers_share_one_port_and_keep_sessions_sticky(server: str) -> None:
    require_binary("envoy")
    # Envoy opens one connection per ext_proc stream (as envoy-config renders it for several
    # workers): the kernel spreads connections over the workers.
    lib = ("--grpc-server=grpclib", "--admin-listen=off") if server == "grpclib" else ()
    with LocalGateway(replicas=3, time_scale=0.02, processor_args=("--workers", "2", *lib)) as gw:
        worker_metrics = gw.worker_metrics_urls
        convs = multi_turn(CONVERSATIONS, TURNS, seed=4, system_tokens=100, document_tokens=300, run_id="workers")
        async with aiohttp.ClientSession() as http:

            async def converse(conv: Conversation) -> tuple[list[int], set[str]]:
                answers = [await send_turn(http, gw.url, conv, t) for t in range(TURNS)]
                return [status for status, _ in answers], {replica for _, replica in answers}

            results = await asyncio.gather(*(converse(c) for c in convs))
            per_worker = await decisions(http, worker_metrics)
    assert all(statuses == [200] * TURNS for statuses, _ in results), results
    assert all(len(replicas) == 1 for _, replicas in results), results
    totals = [sum(c.values()) for c in per_worker]
    assert sum(totals) == CONVERSATIONS * TURNS and min(totals) > 0, per_worker
    # Every turn after the first found its pin, on whichever worker the turn reached.
    assert sum(c["sticky"] for c in per_worker) == CONVERSATIONS * (TURNS - 1), per_worker
