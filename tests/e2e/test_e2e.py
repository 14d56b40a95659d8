"""End to end through real Envoy -> our processor -> fake vLLM replicas, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import CHAT, chat, deciding, post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["cluster", "endpoint"])
def gateway(request: pytest.FixtureRequest) -> Iterator[LocalGateway]:
    require_binary("envoy")
    with LocalGateway(replicas=4, mode=request.param, time_scale=0.02) as gw:
        yield gw


async def test_twenty_turns_of_concurrent_sessions_stay_on_one_replica(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:

        async def converse(i: int) -> set[str]:
            seen = set()
            history = f"session {i} document " + "lorem ipsum dolor sit amet " * 80
            for turn in range(20):
                history += f" turn {turn} question"
                status, replica, _ = await post(http, gateway.url, chat(history), {"x-session-id": f"conv-{i}"})
                assert status == 200
                seen.add(replica)
            return seen

        results = await asyncio.gather(*(converse(i) for i in range(12)))
    assert all(len(seen) == 1 for seen in results), results
    assert len({next(iter(s)) for s in results}) >= 3  # and the sessions themselves are spread


async def test_requests_sharing_a_long_prefix_meet_without_a_session(gateway: LocalGateway) -> None:
    document = "shared contract clause " * 600  # ~14 KB, a long shared document
    async with aiohttp.ClientSession() as http:
        replicas = Counter()
        for q in range(10):
            status, replica, payload = await post(http, gateway.url, chat(document + f" question {q}"))
            assert status == 200
            replicas[replica] += 1
        assert len(replicas) == 1, replicas
        assert payload is not None and payload["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_new_sessions_spread_over_replicas(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(
            *(post(http, gateway.url, chat(f"fresh topic {i} " * 50), {"x-session-id": f"new-{i}"}) for i in range(40))
        )
    counts = Counter(replica for status, replica, _ in results if status == 200)
    assert sum(counts.values()) == 40
    assert len(counts) == 4 and max(counts.values()) <= 20, counts


async def test_client_set_routing_headers_are_ignored(gateway: LocalGateway) -> None:
    target = gateway.members[0]
    forged = {"x-target-cluster": target.name, "x-gateway-destination-endpoint": target.address}
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(
            *(
                post(http, gateway.url, chat(f"forged {i} " * 40), {**forged, "x-session-id": f"f-{i}"})
                for i in range(24)
            )
        )
        assert all(status == 200 for status, _, _ in results)
        assert Counter(r for _, r, _ in results)[target.name] < 24
        bogus = {"x-target-cluster": "no-such-cluster", "x-gateway-destination-endpoint": "127.0.0.1:1"}
        status, _, _ = await post(http, gateway.url, chat("bogus"), bogus)
        assert status == 200


async def test_bad_bodies_are_answered_cleanly_and_serving_goes_on(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        for body in (b"{not json", b"\x00\xff\xfe binary", b"", b"[1, 2, 3]"):
            status, replica, _ = await post(http, gateway.url, body, {"x-session-id": "bad"})
            assert status == 400 and replica  # routed by fallback; the replica explains what is wrong
        # Over the processor's parse limit (8 MiB) but under Envoy's buffer: routed on the session.
        big = json.dumps(chat("y" * (9 * 1024 * 1024))).encode()
        status, replica, _ = await post(http, gateway.url, big, {"x-session-id": "big"})
        assert status == 200 and replica
        # Over Envoy's buffer limit: a clear 413 from Envoy, not a hang or a 500.
        huge = json.dumps(chat("z" * (17 * 1024 * 1024))).encode()
        status, _, _ = await post(http, gateway.url, huge)
        assert status == 413
        status, _, _ = await post(http, gateway.url, chat("still serving"), {"x-session-id": "after"})
        assert status == 200


async def test_streaming_requests_are_routed_and_stick(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        seen = set()
        for turn in range(5):
            body = chat("streaming conversation " * 40 + str(turn), stream=True)
            async with http.post(gateway.url + CHAT, json=body, headers={"x-session-id": "stream-1"}) as resp:
                assert resp.status == 200
                text = await resp.text()
                assert "data: [DONE]" in text
                seen.add(resp.headers["x-replica-name"])
        assert len(seen) == 1


async def test_killing_the_processor_falls_back_to_the_default_route() -> None:
    require_binary("envoy")
    with LocalGateway(replicas=3, mode="cluster", time_scale=0.02) as gw:
        async with aiohttp.ClientSession() as http:

            async def burst(tag: str, n: int) -> list[tuple[int, str]]:
                out = []
                for i in range(n):
                    status, replica, _ = await post(http, gw.url, chat(f"{tag} {i}"), {"x-session-id": f"{tag}"})
                    out.append((status, replica))
                return out

            before = await burst("k", 10)
            assert all(s == 200 for s, _ in before) and len({r for _, r in before}) == 1
            gw.procs.kill("processor")
            during = await burst("k", 12)
            assert all(s == 200 for s, _ in during), during
            assert len({r for _, r in during}) > 1  # plain round robin now
            gw.start_processor()
            await deciding(http, gw)
            after = await burst("k2", 10)
            assert all(s == 200 for s, _ in after) and len({r for _, r in after}) == 1
