"""Where the hit ratio goes, through real Envoy on fake replicas and on real vLLM engines: the same
multi-turn workload routed by our profile and by a round-robin picker. The workload offers the
same reuse to both; ours captures nearly all of it, round robin a small share; the engines' own
counters follow."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.adapters.admin.tables import reuse_rows
from extproc.fleet.cache.reuse import Shares, shares
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import words
from tests.conftest import require_binary
from tests.e2e.conftest import TinyEngines

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
    return shares(reuse_rows(reply)), reply


async def table(gw: LocalGateway) -> str:
    """What ``extproc admin hit-ratio`` prints."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "extproc", "admin", "--server", gw.admin_addresses[0], "hit-ratio"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    return done.stdout


async def measured(gw: LocalGateway) -> tuple[Shares, str]:
    found, reply = await decomposed(gw.admin_addresses[0])
    assert {r.replica for r in reply.rows} == {r.name for r in gw.members}
    return found, await table(gw)


async def run(tmp_path: Path, name: str, profile: dict[str, object] | None) -> tuple[Shares, str]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"profile": profile} if profile else {}))
    with LocalGateway(replicas=4, time_scale=0.05, processor_args=("--config", str(config))) as gw:
        await asyncio.sleep(1)  # a scrape or two: the engines' counters read before any traffic
        await converse(gw.url, name)
        await asyncio.sleep(1)  # and after it
        return await measured(gw)


async def test_round_robin_captures_a_small_share_of_the_offered_reuse_and_ours_nearly_all(tmp_path: Path) -> None:
    require_binary("envoy")
    ours, ours_table = await run(tmp_path, "ours", None)
    rr, rr_table = await run(tmp_path, "round-robin", {"picker": {"type": "in_turn"}})
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


# -- real vLLM engines ------------------------------------------------------------------------------

VLLM_SESSIONS, VLLM_TURNS, OPENING_TOKENS, TURN_TOKENS = 4, 4, 40, 200


def vllm_sessions(seed: int) -> list[list[str]]:
    """Each session's prompts, turn by turn: an opening and ~200 tokens more a turn, in the words
    the lab's model was trained on."""
    rng = random.Random(seed)
    out = []
    for _ in range(VLLM_SESSIONS):
        history, turns = words(rng, OPENING_TOKENS), []
        for _ in range(VLLM_TURNS):
            history += " " + words(rng, TURN_TOKENS)
            turns.append(history)
        out.append(turns)
    return out


async def converse_turn_by_turn(url: str, tag: str, seed: int) -> None:
    """One request at a time, every session's first turn, then every session's second, ...: with
    four sessions over three replicas, round robin sends each session's next turn to another
    replica than its last (one CPU engine at a time, so nothing waits on a busy core)."""
    sessions = vllm_sessions(seed)
    async with aiohttp.ClientSession() as http:
        for t in range(VLLM_TURNS):
            for i, turns in enumerate(sessions):
                body = {"model": "demo-model", "messages": [{"role": "user", "content": turns[t]}], "max_tokens": 2}
                async with http.post(
                    f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"{tag}-{i}"}
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()


async def test_on_real_vllm_engines_round_robin_captures_little_and_ours_nearly_all(
    tmp_path: Path, tiny_engines: TinyEngines
) -> None:
    """The session's three vLLM CPU engines (tests/e2e/conftest.py), their caches emptied; the
    processor restarted for each profile (new counts, and prompts of a seed of their own, so the
    first run's cached blocks offer the second nothing)."""
    require_binary("envoy")
    configs = {}
    for name, profile in (("ours", None), ("round-robin", {"picker": {"type": "in_turn"}})):
        configs[name] = tmp_path / f"{name}.yaml"
        # A CPU engine busy on both cores can take longer than the default 0.2 s to serve /metrics.
        text: dict[str, object] = {"health": {"scrape_timeout_s": 1.0}}
        if profile:
            text["profile"] = profile
        configs[name].write_text(yaml.safe_dump(text))
    gateway = LocalGateway(
        replicas=3,
        engines=tiny_engines.fresh(),
        log_dir=tmp_path / "gw",
        processor_args=("--config", str(configs["ours"])),
    )
    found: dict[str, tuple[Shares, str]] = {}
    with gateway as gw:
        for seed, name in enumerate(configs):
            if name != "ours":
                gw.procs.stop(gw.processor_name())
                gw.processor_args = ("--config", str(configs[name]))
                gw.start_processor()
            await asyncio.sleep(2)  # scrapes: the engines' counters read before any traffic
            await converse_turn_by_turn(gw.url, name, seed)
            await asyncio.sleep(2)  # real time: the gateway's scrapes after the turns
            found[name] = await measured(gw)
    (ours, ours_table), (rr, rr_table) = found["ours"], found["round-robin"]
    print(f"ours:\n{ours_table}\nround robin:\n{rr_table}")
    assert ours.offered is not None and rr.offered is not None
    assert ours.offered > 0.5 and abs(ours.offered - rr.offered) < 0.15, (ours, rr)
    assert ours.captured is not None and ours.captured > 0.9, ours
    assert rr.captured is not None and rr.captured < 0.4, rr
    assert ours.engine_hit_ratio is not None and rr.engine_hit_ratio is not None
    assert ours.engine_hit_ratio > rr.engine_hit_ratio + 0.2, (ours, rr)
    assert ours.delivered is not None and ours.delivered > 0.7, ours
