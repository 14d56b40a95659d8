"""KV events end to end: real Envoy, two processors (memory stores, no Redis), three fake vLLM
replicas publishing KV events (ipc://, one in the older array encoding), all on this machine.

Each check is made sharp by giving a second replica part of the same conversation (a prefix of
its blocks): the router must prefer the replica holding more, and move to the other as soon as
the events say the blocks are gone. Prompts are seeded on replicas directly, bypassing Envoy, so
only the events can tell the processors where they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir, sample_text
from tests.conftest import require_binary
from tests.helpers import metrics_page, scrape, wait_for

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
MODEL = "demo-model"
REPLICAS = ("replica-0", "replica-1", "replica-2")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    require_binary("envoy")
    tok = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    sockets = tmp_path_factory.mktemp("kv")
    labels, replica_args = {}, {}
    for name in REPLICAS:
        pub, replay = f"ipc://{sockets}/{name}.pub", f"ipc://{sockets}/{name}.replay"
        labels[name] = {"kv_events": pub, "kv_replay": replay}
        encoding = "array" if name == "replica-1" else "map"
        replica_args[name] = ("--tokenizer", str(tok), "--kv-events", pub, "--kv-replay", replay,
                              "--kv-events-encoding", encoding)  # fmt: skip
    gw = LocalGateway(
        replicas=len(REPLICAS),
        time_scale=0.02,
        processors=2,
        labels=labels,
        replica_args=replica_args,
        # Every response body is read for its cached tokens (streamed through, never held).
        processor_args=("--tokenizer", f"{MODEL}={tok}", "--kv-check-sample-rate", "1"),
    )
    with gw:
        yield gw


def conversation(seed: int, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": sample_text(80, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": sample_text(25, seed * 100 + t)})
        msgs.append({"role": "assistant", "content": sample_text(10, seed * 1000 + t)})
    return msgs[:-1]  # ends on a user turn


async def post(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], **headers: str) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    async with http.post(url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers.get("x-replica-name", "")


async def metrics(http: aiohttp.ClientSession, gw: LocalGateway) -> list[str]:
    return [await metrics_page(http, url) for url in gw.metrics_urls]


async def synced(http: aiohttp.ClientSession, gw: LocalGateway) -> None:
    """Wait until both processors applied every batch each replica published."""
    wanted = {}
    for name in REPLICAS:
        async with http.get(gw.replica_url(name) + "/kv_events") as resp:
            wanted[name] = (await resp.json())["next_seq"] - 1

    async def check() -> bool:
        pages = await metrics(http, gw)
        return all(
            scrape(p, "extproc_kv_feed_last_seq", replica=n) == seq
            and scrape(p, "extproc_kv_feed_live", replica=n) == 1
            for p in pages
            for n, seq in wanted.items()
        )

    try:
        await wait_for(check, within_s=10.0)
    except AssertionError:
        pages = await metrics(http, gw)
        seen = [
            {
                n: (scrape(p, "extproc_kv_feed_last_seq", replica=n), scrape(p, "extproc_kv_feed_live", replica=n))
                for n in wanted
            }
            for p in pages
        ]
        logs = "\n".join(gw.procs.log_tail(gw.processor_name(i), 15) for i in range(gw.processors))
        raise AssertionError(f"processors not in sync: wanted {wanted}, saw {seen}\n{logs}") from None


async def seed(http: aiohttp.ClientSession, gw: LocalGateway, replica: str, messages: list[dict[str, str]]) -> None:
    assert await post(http, gw.replica_url(replica), messages) == replica


async def routed(http: aiohttp.ClientSession, gw: LocalGateway, messages: list[dict[str, str]], n: int = 4) -> set[str]:
    """Where ``n`` requests of ``messages`` go through Envoy (no session: only the cache says)."""
    return {await post(http, gw.url, messages) for _ in range(n)}


async def test_a_prompt_goes_where_its_blocks_are_and_both_gateways_agree(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        for seed_, holder, partial in ((1, "replica-1", "replica-0"), (2, "replica-2", "replica-1")):
            full = conversation(seed_, 2)
            await seed(http, gateway, partial, conversation(seed_, 1))  # a prefix of its blocks
            await seed(http, gateway, holder, full)
            await synced(http, gateway)
            assert await routed(http, gateway, full, n=6) == {holder}
        pages = await metrics(http, gateway)
        # Both processors decided (Envoy spreads streams over them), each with its own memory store.
        assert all((scrape(p, "extproc_decisions_total", reason="prefix", model=MODEL) or 0) > 0 for p in pages)


async def test_reset_moves_the_prompt_within_200ms(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        full = conversation(3, 2)
        await seed(http, gateway, "replica-0", conversation(3, 1))
        await seed(http, gateway, "replica-1", full)
        await synced(http, gateway)
        assert await routed(http, gateway, full) == {"replica-1"}
        start = time.monotonic()
        async with http.post(gateway.replica_url("replica-1") + "/reset_prefix_cache") as resp:
            assert resp.status == 200

        async def cleared() -> bool:
            pages = await metrics(http, gateway)
            return all(scrape(p, "extproc_kv_index_blocks", replica="replica-1") == 0 for p in pages)

        await wait_for(cleared, within_s=2.0)
        took = time.monotonic() - start
        assert took < 0.2, f"the processors forgot replica-1's blocks after {took:.3f}s"
        assert await routed(http, gateway, full) == {"replica-0"}


async def test_engine_restart_clears_its_blocks(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        full = conversation(4, 2)
        await seed(http, gateway, "replica-0", conversation(4, 1))
        await seed(http, gateway, "replica-2", full)
        await synced(http, gateway)
        assert await routed(http, gateway, full) == {"replica-2"}
        member = next(r for r in gateway.members if r.name == "replica-2")
        gateway.procs.stop("replica-2")
        gateway.start_replica(member)
    async with aiohttp.ClientSession() as http:  # no kept-alive connection to the old process
        await seed(http, gateway, "replica-2", conversation(40, 1))  # the new engine's first batch: seq 0

        async def restarted() -> bool:  # live, or (lost before the SUB reconnected) on reconnecting
            pages = await metrics(http, gateway)
            return all(scrape(p, "extproc_kv_event_restarts_total", replica="replica-2") == 1 for p in pages)

        await wait_for(restarted, within_s=10.0)
        await synced(http, gateway)
        assert await routed(http, gateway, full) == {"replica-0"}


async def test_a_lost_batch_is_recovered_by_replay(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        full = conversation(5, 2)
        await seed(http, gateway, "replica-1", conversation(5, 1))
        async with http.post(gateway.replica_url("replica-0") + "/kv_events/drop?n=1") as resp:
            assert resp.status == 200
        await seed(http, gateway, "replica-0", full)  # its stores never reach the processors...
        await seed(http, gateway, "replica-0", conversation(41, 1))  # ...until this batch shows the gap
        await synced(http, gateway)
        pages = await metrics(http, gateway)
        for p in pages:
            assert scrape(p, "extproc_kv_event_gaps_total", replica="replica-0") == 1
            assert (scrape(p, "extproc_kv_event_replays_total", replica="replica-0", outcome="ok") or 0) >= 2
            assert scrape(p, "extproc_kv_event_clears_total", replica="replica-0", cause="gap") is None
        assert await routed(http, gateway, full) == {"replica-0"}


async def test_restarted_routers_refind_live_conversations_from_replayed_events(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        for i in range(gateway.processors):
            gateway.procs.stop(gateway.processor_name(i))
        # While no router runs, conversations go on (published events reach no subscriber).
        sessions = {f"conv-{i}": (conversation(60 + i, 2), REPLICAS[i % 3]) for i in range(6)}
        for messages, replica in sessions.values():
            await seed(http, gateway, replica, messages[:-2])
            await seed(http, gateway, replica, messages)
        for i in range(gateway.processors):
            gateway.start_processor(i)
        await synced(http, gateway)  # from the replay buffers alone
        for session, (messages, replica) in sessions.items():
            next_turn = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
            assert await post(http, gateway.url, next_turn, **{"x-session-id": session}) == replica, session


async def prediction_checks(http: aiohttp.ClientSession, gw: LocalGateway, replica: str) -> dict[str, float]:
    """Per outcome, the checks of predicted against reported cached tokens, over both processors."""
    pages = await metrics(http, gw)
    return {
        o: sum(scrape(p, "extproc_kv_prediction_checks_total", replica=replica, outcome=o) or 0 for p in pages)
        for o in ("agree", "over", "under", "unreported")
    }


async def test_predicted_hits_are_checked_against_the_cached_tokens_in_response_bodies(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        full = conversation(8, 2)
        await seed(http, gateway, "replica-2", full)
        await synced(http, gateway)
        before = await prediction_checks(http, gateway, "replica-2")
        body = {"model": MODEL, "messages": full, "max_tokens": 2}
        async with http.post(gateway.url + CHAT, json=body) as resp:
            assert resp.status == 200 and resp.headers["x-replica-name"] == "replica-2"
            reply = await resp.json()  # the body read on the way reaches the client whole
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(gateway.url + CHAT, json=stream) as resp:
            assert resp.status == 200 and resp.headers["x-replica-name"] == "replica-2"
            text = await resp.text()
        assert '"cached_tokens"' in text and text.rstrip().endswith("data: [DONE]")

        async def agreed() -> bool:
            now = await prediction_checks(http, gateway, "replica-2")
            return now["agree"] == before["agree"] + 2

        await wait_for(agreed, within_s=5.0)
        # A stale index: the replica's reset never reaches the processors (its batch is lost), so
        # they still predict the whole prompt cached there, and the replica reports nothing cached.
        async with http.post(gateway.replica_url("replica-2") + "/kv_events/drop?n=1") as resp:
            assert resp.status == 200
        async with http.post(gateway.replica_url("replica-2") + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        async with http.post(gateway.url + CHAT, json=body) as resp:
            assert resp.headers["x-replica-name"] == "replica-2"
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        async def overpredicted() -> bool:
            now = await prediction_checks(http, gateway, "replica-2")
            return now["over"] == before["over"] + 1

        await wait_for(overpredicted, within_s=5.0)
        await synced(http, gateway)  # the next batch showed the gap; the replay brought the reset


def test_replicas_connecting_to_one_bound_endpoint(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The other layout: the processor binds ``--kv-events-listen`` and the engines connect to it
    (vLLM connects when its endpoint names a host), the topic naming the replica."""
    from extproc_lab.demo.processes import free_port

    require_binary("envoy")
    tok = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replica_args = {name: ("--tokenizer", str(tok), "--kv-events", endpoint) for name in REPLICAS}
    gw = LocalGateway(
        replicas=len(REPLICAS),
        time_scale=0.02,
        replica_args=replica_args,
        processor_args=("--tokenizer", f"{MODEL}={tok}", "--kv-events-listen", endpoint),
    )

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            fresh = iter(range(100, 200))

            async def connected() -> bool:
                # The engines connect a moment after the processor binds, and what they publish
                # before that is lost (no replay in this layout): probe with fresh prompts.
                for name in ("replica-0", "replica-2"):
                    await seed(http, gw, name, conversation(next(fresh), 1))
                page = (await metrics(http, gw))[0]
                return all(
                    (scrape(page, "extproc_kv_index_blocks", replica=n) or 0) > 0 for n in ("replica-0", "replica-2")
                )

            await wait_for(connected, step_s=0.2, within_s=10.0)
            full = conversation(7, 2)
            await seed(http, gw, "replica-0", conversation(7, 1))
            await seed(http, gw, "replica-2", full)

            async def applied() -> bool:
                page = (await metrics(http, gw))[0]
                for name in ("replica-0", "replica-2"):
                    async with http.get(gw.replica_url(name) + "/kv_events") as resp:
                        if (
                            scrape(page, "extproc_kv_feed_last_seq", replica=name)
                            != (await resp.json())["next_seq"] - 1
                        ):
                            return False
                return True

            await wait_for(applied, within_s=10.0)
            assert await routed(http, gw, full) == {"replica-2"}

    with gw:
        asyncio.run(scenario())
