"""Where the hit ratio goes, through real Envoy on fake replicas: the same multi-turn workload
routed by our profile and by a round-robin picker. The workload offers the same reuse to both;
ours captures nearly all of it, round robin a small share; the engines' own counters follow."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.cache.reuse import ReuseRow, Shares, shares
from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e

# Three at a time over four replicas: with as many sessions in step as replicas, round robin would
# send each session back to the same replica every turn by accident.
SESSIONS, TURNS, CONCURRENCY = 16, 4, 3


async def converse(url: str, tag: str) -> None:
    """Sessions of a few turns whose history grows by ~1,000 characters (16 blocks) a turn, as a
    chat's does with its answers, on a short opening of their own."""
    gate = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession() as http:

        async def session(i: int) -> None:
            history = f"{tag} session {i}: " + f"the opening of session {i} " * 8
            async with gate:
                for t in range(TURNS):
                    history += f" turn {t}: " + f"more words of turn {t} in session {i} " * 25
                    body = {"model": "demo-model", "messages": [{"role": "user", "content": history}], "max_tokens": 2}
                    headers = {"x-session-id": f"{tag}-{i}"}
                    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                        assert r.status == 200
                        await r.read()

        await asyncio.gather(*(session(i) for i in range(SESSIONS)))


async def decomposed(address: str) -> tuple[Shares, pb.HitRatioResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.AdminStub(channel).GetHitRatio(pb.HitRatioRequest(), timeout=10)
    rows = [
        ReuseRow(
            r.pool,
            r.replica,
            r.prompt_blocks,
            r.offered_blocks,
            r.captured_blocks,
            r.engine_queries_tokens,
            r.engine_hits_tokens,
        )
        for r in reply.rows
    ]
    return shares(rows), reply


async def run(tmp_path: Path, name: str, profile: dict[str, object] | None) -> tuple[Shares, str]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"profile": profile} if profile else {}))
    with LocalGateway(replicas=4, time_scale=0.05, processor_args=("--config", str(config))) as gw:
        await asyncio.sleep(1)  # a scrape or two: the engines' counters read before any traffic
        await converse(gw.url, name)
        await asyncio.sleep(1)  # and after it
        found, reply = await decomposed(gw.admin_addresses[0])
        assert {r.replica for r in reply.rows} == {r.name for r in gw.members}
        table = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "extproc", "admin", "--server", gw.admin_addresses[0], "hit-ratio"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
            env={**os.environ, "COLUMNS": "200"},
        )
    return found, table.stdout


async def test_round_robin_captures_a_small_share_of_the_offered_reuse_and_ours_nearly_all(tmp_path: Path) -> None:
    require_binary("envoy")
    ours, ours_table = await run(tmp_path, "ours", None)
    rr, rr_table = await run(tmp_path, "round-robin", {"picker": {"type": "round_robin"}})
    print(f"ours:\n{ours_table}\nround robin:\n{rr_table}")
    assert ours.offered is not None and rr.offered is not None
    # The same workload offers about the same reuse whatever routes it (turns 2-4 find their history).
    assert 0.5 < ours.offered < 0.9 and abs(ours.offered - rr.offered) < 0.1, (ours, rr)
    assert ours.captured is not None and ours.captured > 0.9, ours
    assert rr.captured is not None and rr.captured < 0.4, rr
    # What the engines found follows where the requests went.
    assert ours.engine_hit_ratio is not None and rr.engine_hit_ratio is not None
    assert ours.engine_hit_ratio > rr.engine_hit_ratio + 0.2, (ours, rr)
    assert ours.delivered is not None and ours.delivered > 0.7, ours
    assert "CAPTURED%" in ours_table and "(all)" in rr_table
