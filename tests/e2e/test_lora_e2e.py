"""LoRA adapters through real Envoy, the processor and fake replicas that load adapters."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import metrics_page, turn, wait_for

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
REPLICA_ARGS = {
    "replica-0": ("--max-lora", "2", "--lora-adapters", "sql-lora"),  # holds it, a slot free
    "replica-1": ("--max-lora", "2", "--lora-adapters", "chat-a,chat-b"),  # slots full
    "replica-2": ("--max-lora", "2", "--lora-adapters", "code-a,code-b"),  # slots full
    "replica-3": ("--max-lora", "2"),  # LoRA on, nothing loaded
}


async def all_scraped(http: aiohttp.ClientSession, gw: LocalGateway) -> bool:
    """Whether the processor has scraped every replica and has it in rotation."""
    text = await metrics_page(http, gw.metrics_url)
    return all(
        f'extproc_replica_last_scrape_timestamp_seconds{{replica="{r.name}"}}' in text
        and f'extproc_replica_in_rotation{{replica="{r.name}"}} 1.0' in text
        for r in gw.members
    )


async def test_adapter_requests_go_where_the_adapter_is_loaded() -> None:
    require_binary("envoy")
    with LocalGateway(replicas=4, time_scale=0.05, replica_args=REPLICA_ARGS) as gw:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await wait_for(lambda: all_scraped(http, gw), "every replica scraped", within_s=10.0, step_s=0.1)
            # The replica's own view: sql-lora is loaded on replica-0 only.
            async with http.get(gw.replica_url("replica-0") + "/metrics") as resp:
                assert 'running_lora_adapters="sql-lora"' in await resp.text()

            async def converse(session: str) -> list[tuple[int, str]]:
                history, out = f"{session}: write SQL for the report", []
                for t in range(3):
                    history += f" turn {t} more details"
                    out.append((await turn(http, gw.url, session, history, model="sql-lora"))[:2])
                    await asyncio.sleep(0.02)  # real time: a client's think time between turns
                return out

            results = await asyncio.wait_for(asyncio.gather(*(converse(f"sql-{i}") for i in range(8))), 60)
            turns = [t for r in results for t in r]
            assert all(status == 200 for status, _ in turns), turns
            where = Counter(replica for _, replica in turns)
            assert not where.keys() & {"replica-1", "replica-2"}, where  # never forces a swap on a full replica
            assert where["replica-0"] >= 0.75 * len(turns), where  # the replica that holds it, mostly
            print(f"sql-lora turns per replica: {dict(sorted(where.items()))}")

            # The base model is still served anywhere, full replicas included.
            base = await asyncio.gather(*(turn(http, gw.url, f"b{i}", f"base {i}") for i in range(8)))
            assert all(status == 200 for status, _, _ in base)
