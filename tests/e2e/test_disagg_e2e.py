"""Prefill/decode disaggregation through real Envoy (docs/disaggregation.md, design (b)): the
processor routes to a decode replica and names the prefill replica in ``x-prefiller-host-port``;
the fake of llm-d's sidecar in front of each decode replica makes the prefill hop, and the decode
replica pulls the prompt's blocks. One gateway serves the module: two prefill replicas, two decode
replicas each behind its sidecar; every test uses prompts of its own and counts differences."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc.routing.roles import ROLE_LABEL
from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import chat, deciding, metrics_page, post, scrape_total

pytestmark = pytest.mark.e2e

PREFILL = ("replica-0", "replica-1")
DECODE = ("replica-2", "replica-3")
HOP_TIMEOUT_S = 1.0  # the sidecars' bound on a prefill hop (a hung prefill replica costs this)
# llm-d's threshold decider: a hop whenever the decode replica lacks 256 tokens or more (an idle
# decode replica would otherwise prefill itself, and these tests would see no hop).
CONFIG = "disaggregation:\n  weigh_local: false\n"
_ids = itertools.count()


def disaggregated_gateway(directory: Path, mode: str = "cluster") -> LocalGateway:
    """Two prefill replicas, two decode replicas each behind its sidecar, Envoy in ``mode``."""
    require_binary("envoy")
    config = directory / "router.yaml"
    config.write_text(CONFIG)
    labels = {name: {ROLE_LABEL: "prefill"} for name in PREFILL} | {name: {ROLE_LABEL: "decode"} for name in DECODE}
    timeout = ("--sidecar-prefill-timeout-s", str(HOP_TIMEOUT_S))
    return LocalGateway(
        replicas=4,
        mode=mode,
        time_scale=0.05,
        labels=labels,
        sidecars=DECODE,
        replica_args={name: timeout for name in DECODE},
        processor_args=("--config", str(config)),
    )


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    with disaggregated_gateway(Path(tmp_path_factory.mktemp("disagg"))) as gateway:
        yield gateway


@asynccontextmanager
async def client(gw: LocalGateway) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        await deciding(http, gw)
        yield http


def long_prompt() -> str:
    """A prompt of its own (its first block differs from every other's), about 900 tokens."""
    return f"request {next(_ids)} " + "a long document to summarise, sentence after sentence. " * 65


def cached_tokens(payload: dict[str, Any] | None) -> int:
    usage = (payload or {}).get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, url
        return await resp.json()


async def sidecar_stats(http: aiohttp.ClientSession, gw: LocalGateway) -> dict[str, Any]:
    """The decode replicas' sidecars' counters, summed: hops, failed hops, prefill replicas named."""
    hops, failed, named = 0, 0, {}
    for name in DECODE:
        stats = await get_json(http, gw.replica_url(name) + "/sidecar")
        hops, failed = hops + stats["hops"], failed + stats["failed_hops"]
        for address, n in stats["prefillers"].items():
            named[address] = named.get(address, 0) + n
    return {"hops": hops, "failed_hops": failed, "prefillers": named}


async def set_faults(http: aiohttp.ClientSession, gw: LocalGateway, names: tuple[str, ...], **faults: str) -> None:
    for name in names:
        async with http.post(gw.backend_url(name) + "/kv_transfer/faults", json=faults) as resp:
            assert resp.status == 200


@asynccontextmanager
async def faulty(http: aiohttp.ClientSession, gw: LocalGateway, names: tuple[str, ...], **faults: str) -> Any:
    """``faults`` on ``names`` for the block's duration (cleared after, for the tests that follow)."""
    await set_faults(http, gw, names, **faults)
    try:
        yield
    finally:
        await set_faults(http, gw, names, prefill="ok", fetch="ok")


async def send_long(http: aiohttp.ClientSession, gw: LocalGateway, n: int) -> list[tuple[int, str, int]]:
    """``n`` long prompts at once: (status, replica that answered, cached tokens it reported)."""
    answers = await asyncio.gather(
        *(post(http, gw.url, chat(long_prompt()), {"x-session-id": f"long-{next(_ids)}"}) for _ in range(n))
    )
    return [(status, replica, cached_tokens(payload)) for status, replica, payload in answers]


async def test_long_prompts_are_prefilled_elsewhere_and_arrive_cached_at_their_decode_replica(gw: LocalGateway) -> None:
    async with client(gw) as http:
        before = await sidecar_stats(http, gw)
        page = await metrics_page(http, gw.metrics_url)
        hops_before = scrape_total(page, "extproc_disagg_decisions_total", outcome="disaggregated")
        answers = await send_long(http, gw, 8)
        assert [status for status, _, _ in answers] == [200] * 8
        assert {replica for _, replica, _ in answers} <= set(DECODE)  # a prefill replica never decodes
        # The blocks crossed: the decode replica reports the prompt (all but its last block) cached.
        assert all(cached >= 800 for _, _, cached in answers), answers
        after = await sidecar_stats(http, gw)
        assert after["hops"] - before["hops"] == 8 and after["failed_hops"] == before["failed_hops"]
        prefill_addresses = {r.address for r in gw.members if r.name in PREFILL}
        assert set(after["prefillers"]) <= prefill_addresses
        page = await metrics_page(http, gw.metrics_url)
        assert scrape_total(page, "extproc_disagg_decisions_total", outcome="disaggregated") - hops_before == 8
        per_replica = {name: scrape_total(page, "extproc_disagg_prefill_hops_total", replica=name) for name in PREFILL}
        assert sum(per_replica.values()) >= 8
        assert scrape_total(page, "extproc_disagg_transfer_blocks_total") > 0
        for name in DECODE:  # the pulls happened, as the decode replicas' own counters say
            state = await get_json(http, gw.backend_url(name) + "/kv_transfer")
            assert state["failed_fetches"] == 0
        fetched = [(await get_json(http, gw.backend_url(n) + "/kv_transfer"))["fetched_blocks"] for n in DECODE]
        assert sum(fetched) > 0


async def test_short_prompts_and_a_conversations_next_turn_stay_on_the_decode_replica(gw: LocalGateway) -> None:
    async with client(gw) as http:
        before = await sidecar_stats(http, gw)
        page = await metrics_page(http, gw.metrics_url)
        short_before = scrape_total(page, "extproc_disagg_decisions_total", outcome="short")
        held_before = scrape_total(page, "extproc_disagg_decisions_total", outcome="held")
        shorts = await asyncio.gather(*(post(http, gw.url, chat(f"hello {i}")) for i in range(4)))
        assert [s for s, _, _ in shorts] == [200] * 4 and {r for _, r, _ in shorts} <= set(DECODE)
        session = {"x-session-id": f"conversation-{next(_ids)}"}
        first = long_prompt()
        status, decoder, _ = await post(http, gw.url, chat(first), session)
        assert status == 200
        status, again, payload = await post(http, gw.url, chat(first + " and one more question"), session)
        assert status == 200 and again == decoder  # pinned to its decode replica
        assert cached_tokens(payload) >= 800
        after = await sidecar_stats(http, gw)
        assert after["hops"] - before["hops"] == 1  # the first turn's only
        page = await metrics_page(http, gw.metrics_url)
        assert scrape_total(page, "extproc_disagg_decisions_total", outcome="short") - short_before >= 4
        assert scrape_total(page, "extproc_disagg_decisions_total", outcome="held") - held_before == 1


@pytest.mark.parametrize("fault", ["fail", "hang"])
async def test_a_failing_or_hung_prefill_replica_costs_no_answer(gw: LocalGateway, fault: str) -> None:
    async with client(gw) as http:
        before = await sidecar_stats(http, gw)
        async with faulty(http, gw, PREFILL, prefill=fault):
            answers = await send_long(http, gw, 4)
        # The sidecar gave up on the hop (a 500, or its timeout) and the decode replica computed
        # the prompt itself: answered, nothing cached.
        assert [status for status, _, _ in answers] == [200] * 4
        assert [cached for _, _, cached in answers] == [0] * 4
        after = await sidecar_stats(http, gw)
        assert after["failed_hops"] - before["failed_hops"] == 4


async def test_a_decode_replica_that_cannot_fetch_recomputes(gw: LocalGateway) -> None:
    async with client(gw) as http:
        failed_before = sum(
            [(await get_json(http, gw.backend_url(n) + "/kv_transfer"))["failed_fetches"] for n in DECODE]
        )
        async with faulty(http, gw, DECODE, fetch="fail"):
            answers = await send_long(http, gw, 4)
        assert [status for status, _, _ in answers] == [200] * 4
        assert [cached for _, _, cached in answers] == [0] * 4
        failed = sum([(await get_json(http, gw.backend_url(n) + "/kv_transfer"))["failed_fetches"] for n in DECODE])
        assert failed - failed_before == 4


async def test_a_prefill_replica_named_by_the_client_never_reaches_the_sidecar(gw: LocalGateway) -> None:
    spoofed = "127.0.0.1:9"  # discard: a prompt sent there would be lost
    async with client(gw) as http:
        short = await post(http, gw.url, chat("hi, prefill elsewhere"), {PREFILLER_HEADER: spoofed})
        long = await post(http, gw.url, chat(long_prompt()), {PREFILLER_HEADER: spoofed})
        assert short[0] == 200 and long[0] == 200
        assert cached_tokens(long[2]) >= 800  # the router's own hop was made instead
        stats = await sidecar_stats(http, gw)
        assert spoofed not in stats["prefillers"]


async def test_in_endpoint_mode_the_hop_is_made_the_same_way(tmp_path: Path) -> None:
    """GIE's protocol: the decode replica's sidecar is the endpoint Envoy is told to use, the
    prefill replica still named in the header beside it."""
    with disaggregated_gateway(tmp_path, mode="endpoint") as endpoint_gw:
        async with client(endpoint_gw) as http:
            answers = await send_long(http, endpoint_gw, 4)
            assert [status for status, _, _ in answers] == [200] * 4
            assert {replica for _, replica, _ in answers} <= set(DECODE)
            assert all(cached >= 800 for _, _, cached in answers), answers
            stats = await sidecar_stats(http, endpoint_gw)
            assert stats["hops"] == 4 and stats["failed_hops"] == 0


async def test_with_the_processor_down_envoy_itself_strips_a_clients_prefill_header(gw: LocalGateway) -> None:
    """Failing open (the processor gone, Envoy's default route), the request reaches a replica
    unrouted; Envoy's own header filter has taken the client's ``x-prefiller-host-port`` out, or a
    decode replica's sidecar would send the prompt wherever it names. Runs last: it restarts the
    processor."""
    spoofed = "127.0.0.1:7"
    async with aiohttp.ClientSession() as http:
        gw.procs.stop("processor")
        try:
            answers = [
                await post(http, gw.url, chat(f"unrouted {i} " + long_prompt()), {PREFILLER_HEADER: spoofed})
                for i in range(12)
            ]
        finally:
            gw.start_processor()
        assert [status for status, _, _ in answers] == [200] * 12
        assert {replica for _, replica, _ in answers} & set(DECODE)  # some went through a sidecar
        assert spoofed not in (await sidecar_stats(http, gw))["prefillers"]


async def test_the_decision_feed_names_each_pair(gw: LocalGateway) -> None:
    """WatchDecisions carries the prefill replica and the pair's reason: a long prompt's hop, a
    short prompt's none."""
    events: list[pb.DecisionEvent] = []
    async with client(gw) as http, grpc.aio.insecure_channel(gw.admin_addresses[0]) as channel:
        watch = pb_grpc.AdminStub(channel).WatchDecisions(pb.WatchRequest(sample_rate=1.0))

        async def collect() -> None:
            async for event in watch:
                events.append(event)

        collecting = asyncio.create_task(collect())
        # The watch is registered when its call reaches the server: short prompts until one shows.
        for i in range(50):
            assert (await post(http, gw.url, chat(f"warm-up {i}")))[0] == 200
            if events:
                break
            await asyncio.sleep(0.1)  # real time: the watch registering on the real server
        assert events, "WatchDecisions sent nothing"
        await asyncio.sleep(0.3)  # a warm-up decision still in transit
        before = len(events)
        status, decoder, _ = await post(http, gw.url, chat(long_prompt()), {"x-session-id": f"feed-{next(_ids)}"})
        assert status == 200
        status, short_decoder, _ = await post(http, gw.url, chat("hello feed"))
        assert status == 200
        for _ in range(50):
            if len(events) - before >= 2:
                break
            await asyncio.sleep(0.1)  # real time: events streaming from the real server
        watch.cancel()
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await collecting
    long_event, short_event = events[before : before + 2]
    assert (long_event.replica, long_event.pair_reason) == (decoder, "disaggregated")
    assert long_event.prefill in PREFILL
    assert (short_event.replica, short_event.prefill, short_event.pair_reason) == (short_decoder, "", "short")
    assert all(e.replica in DECODE for e in events)  # a prefill replica never decodes
