"""KV room through real Envoy (``queueing.kv_room``): a request whose replica's KV is claimed
waits at the gateway, and a conversation's next turn goes ahead of it into the room its last
turn left, finding its history still cached."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import chat, deciding, metrics_page, post, scrape_total

pytestmark = pytest.mark.e2e

# 128 blocks of 16 tokens: a 2,048-token KV, where two prompts of ~1,500 tokens do not fit together.
KV_BLOCKS = 128
PROMPT_WORDS = 1000  # about 6,000 characters, 1,500 tokens at four characters a token


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    require_binary("envoy")
    path = tmp_path_factory.mktemp("room") / "router.yaml"
    config = {
        "queueing": {"kv_room": True, "kv_room_grace_s": 0.5, "kv_room_max_wait_s": 5.0},
        "health": {"scrape_interval_s": 0.1},
    }
    path.write_text(yaml.safe_dump(config))
    gw = LocalGateway(
        replicas=1,
        replica_args={"replica-0": ("--kv-blocks", str(KV_BLOCKS))},
        processor_args=("--config", str(path)),
        # As `extproc envoy-config` renders it for this config: Envoy waits out the hold.
        envoy_options={"queue_wait_s": 5.0},
    )
    with gw:
        yield gw


def words(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(PROMPT_WORDS))


async def timed_post(http: aiohttp.ClientSession, url: str, body: dict, session: str) -> tuple[float, int, int]:
    """When it was answered, its status and the prompt tokens the replica had cached."""
    status, _, payload = await post(http, url, body, {"x-session-id": session})
    usage = (payload or {}).get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return time.monotonic(), status, int(cached)


async def test_a_conversation_s_next_turn_goes_ahead_of_a_waiter_and_finds_its_history(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        await deciding(http, gateway)
        await asyncio.sleep(0.5)  # a few scrapes: the router knows the replica's KV size

        first = chat(words(1), max_tokens=16)

        async def conversation() -> tuple[float, int, int]:
            _, status, _ = await timed_post(http, gateway.url, first, "s1")
            assert status == 200
            follow = {
                **first,
                "messages": [
                    *first["messages"],
                    {"role": "assistant", "content": "an answer"},
                    {"role": "user", "content": "and then?"},
                ],
            }
            return await timed_post(http, gateway.url, follow, "s1")

        async def newcomer() -> tuple[float, int, int]:
            await asyncio.sleep(0.05)  # while s1's first turn runs
            return await timed_post(http, gateway.url, chat(words(2), max_tokens=16), "s2")

        (followed_at, status1, cached1), (came_at, status2, _) = await asyncio.gather(conversation(), newcomer())

        assert (status1, status2) == (200, 200)
        assert followed_at < came_at  # s1's next turn went into its room ahead of s2, which waited
        assert cached1 >= 1000  # and found its history: nothing was prefilled beside it
        page = await metrics_page(http, gateway.metrics_url)
        assert scrape_total(page, "extproc_kv_room_wait_seconds_sum") > 0.1
