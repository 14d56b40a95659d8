"""Active-active through real Envoy: two processors share one Redis behind one Envoy, which
round-robins ext_proc streams between them, so a conversation's turns alternate processors."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from extproc_lab.demo.processes import free_port
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.demo.workload import Conversation, multi_turn
from tests.conftest import require_binary
from tests.helpers import decisions, metrics_page, scrape_total, send_turn

pytestmark = pytest.mark.e2e
NAMESPACE = "e2e"


class SharedGateway:
    """Envoy -> two processors (``--store redis://...``) -> three fake replicas, and the Redis."""

    def __init__(self) -> None:
        redis_port = free_port()
        url = f"redis://127.0.0.1:{redis_port}?namespace={NAMESPACE}"
        self.gw = LocalGateway(replicas=3, time_scale=0.02, processors=2, processor_args=("--store", url))
        self.redis = LocalRedis(self.gw.procs, self.gw.dir, port=redis_port)

    def __enter__(self) -> SharedGateway:
        try:
            self.redis.start()
            self.gw.start()
        except BaseException:
            self.gw.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.gw.stop()  # the Redis is in the gateway's process group: stopped by PID with the rest

    def session_keys(self, session_id: str = "*") -> list[bytes]:
        with self.redis.client() as c:
            return list(c.scan_iter(match=f"ext:{{{NAMESPACE}/*}}:s:{session_id}", count=1000))

    async def pinned(self, session_id: str, within_s: float = 5.0) -> None:
        """Wait until a session's pin is in Redis: the decision's write goes behind it, so a client
        faster than one Redis write (a fake replica answering in milliseconds on a busy machine)
        can reach the other processor first. A real reply takes far longer than the write."""
        deadline = asyncio.get_running_loop().time() + within_s
        while not self.session_keys(session_id):
            assert asyncio.get_running_loop().time() < deadline, f"{session_id} never pinned in Redis"
            await asyncio.sleep(0.005)  # real time: a real processor's write reaching the real Redis


async def store_errors(http: aiohttp.ClientSession, metrics_urls: list[str]) -> int:
    """Failed store operations counted by the processors: each may have answered from local state."""
    pages = [await metrics_page(http, url) for url in metrics_urls]
    return int(sum(scrape_total(page, "extproc_store_errors_total") for page in pages))


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedGateway]:
    require_binary("envoy")
    require_binary("redis-server")
    with SharedGateway() as gateway:
        yield gateway


async def test_turns_alternate_processors_and_stay_on_one_replica(shared: SharedGateway) -> None:
    gw = shared.gw
    async with aiohttp.ClientSession() as http:
        # One conversation alone: Envoy's round robin hands its turns to the processors in turn.
        before = await decisions(http, gw.metrics_urls)
        (alone,) = multi_turn(1, 6, seed=1, system_tokens=100, document_tokens=300, run_id="alone")
        seen = {(await send_turn(http, gw.url, alone, t))[1] for t in range(6)}
        after = await decisions(http, gw.metrics_urls)
        per_processor = [after[i] - before[i] for i in range(2)]
        assert len(seen) == 1, seen
        assert [sum(c.values()) for c in per_processor] == [3, 3], per_processor
        # Only the first turn was new; every later turn, on either processor, found the pin.
        assert sum(c["sticky"] for c in per_processor) == 5, per_processor
        assert sum(c["new_session"] for c in per_processor) == 1, per_processor

        # Many conversations at once.
        convs = multi_turn(10, 6, seed=2, system_tokens=100, document_tokens=300, run_id="many")

        async def converse(conv: Conversation) -> set[str]:
            replicas = set()
            for t in range(6):
                status, replica = await send_turn(http, gw.url, conv, t)
                assert status == 200
                replicas.add(replica)
                if t == 0:
                    await shared.pinned(conv.session_id)
            return replicas

        before, errors_before = await decisions(http, gw.metrics_urls), await store_errors(http, gw.metrics_urls)
        results = await asyncio.gather(*(converse(c) for c in convs))
        after, errors = await decisions(http, gw.metrics_urls), await store_errors(http, gw.metrics_urls)
        errors -= errors_before
    assert all(len(r) == 1 for r in results), results
    assert len({next(iter(r)) for r in results}) >= 2  # the conversations themselves are spread
    per_processor = [after[i] - before[i] for i in range(2)]
    totals = [sum(c.values()) for c in per_processor]
    assert sum(totals) == 60 and min(totals) >= 20, per_processor
    # A lookup that timed out on a busy machine is answered from the processor's own state, which
    # may not hold a pin the other processor made: only such a counted failure excuses a miss.
    assert 60 - 10 - errors <= sum(c["sticky"] for c in per_processor) <= 60 - 10, (per_processor, errors)


async def test_killing_redis_mid_replay_fails_no_request_and_state_returns(shared: SharedGateway) -> None:
    gw, redis = shared.gw, shared.redis
    convs = multi_turn(8, 9, seed=3, system_tokens=100, document_tokens=300, run_id="outage")
    total = 8 * 9
    statuses: list[int] = []
    progress = asyncio.Event()

    async def converse(http: aiohttp.ClientSession, conv: Conversation) -> None:
        for t in range(9):
            status, _ = await send_turn(http, gw.url, conv, t)
            statuses.append(status)
            progress.set()
            await asyncio.sleep(0.01)  # real time: a client's think time between turns

    async def answered(count: int) -> None:
        while len(statuses) < count:
            progress.clear()
            await progress.wait()

    async with aiohttp.ClientSession() as http:
        replay = asyncio.gather(*(converse(http, c) for c in convs))
        await answered(total // 3)
        redis.kill()
        await answered(2 * total // 3)
        during = len(statuses)
        redis.start()
        await replay
        assert len(statuses) == total and Counter(statuses) == {200: total}, Counter(statuses)
        assert during < total  # some of the replay ran after Redis came back

        # Both processors noticed the outage, and both are back on Redis.
        for url in gw.metrics_urls:
            deadline = asyncio.get_running_loop().time() + 5
            while (await read_metrics(http, url))["extproc_store_available{}"] != 1:
                assert asyncio.get_running_loop().time() < deadline, f"{url}: store still unavailable"
                await asyncio.sleep(0.1)  # real time: real processors probing the real Redis
        assert await store_errors(http, gw.metrics_urls) >= 1
        for index in range(2):
            log = (gw.dir / f"{gw.processor_name(index)}.log").read_text()
            # Logged once per episode, however many requests it touched (here, at most one).
            assert log.count("unavailable") == log.count("is back") <= 1, log[-2000:]

        # The restarted Redis started empty: pins in it now were written after it returned.
        fresh = multi_turn(4, 2, seed=4, system_tokens=50, document_tokens=100, run_id="after")
        for conv in fresh:
            for t in range(2):
                assert (await send_turn(http, gw.url, conv, t))[0] == 200
        deadline = asyncio.get_running_loop().time() + 5
        while len(shared.session_keys()) < 4:
            assert asyncio.get_running_loop().time() < deadline, shared.session_keys()
            await asyncio.sleep(0.05)  # real time: writes reaching the real Redis


async def test_keyless_conversations_are_known_through_redis_by_both_processors(shared: SharedGateway) -> None:
    gw = shared.gw
    convs = multi_turn(6, 4, seed=5, system_tokens=100, document_tokens=100, run_id="keyless")

    async def converse(http: aiohttp.ClientSession, conv: Conversation) -> list[str]:
        replicas = []
        for t in range(4):
            body = {"model": "demo-model", "messages": conv.next_messages(t), "max_tokens": 2}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:  # no session header
                assert resp.status == 200
                conv.add_answer((await resp.json())["choices"][0]["message"]["content"])
                replicas.append(resp.headers.get("x-replica-name", ""))
        return replicas

    async with aiohttp.ClientSession() as http:
        before = await decisions(http, gw.metrics_urls)
        seen = [await converse(http, c) for c in convs]  # one at a time: turns alternate processors
        after = await decisions(http, gw.metrics_urls)
    assert all(len(set(r)) == 1 for r in seen), seen
    per_processor = [after[i] - before[i] for i in range(2)]
    assert [sum(c.values()) for c in per_processor] == [12, 12], per_processor
    # Every later turn found its conversation, on either processor, and its pin.
    assert sum(c["sticky"] for c in per_processor) == 6 * 3, per_processor
    with shared.redis.client() as c:
        assert len(list(c.scan_iter(match=f"ext:{{{NAMESPACE}/*}}:c:*", count=1000))) >= 6 * 4
