"""The admin API against real Envoy, real processors and fake replicas (and a real Redis):
Explain agrees with where the request then goes, cordons keep pinned sessions and take no new
ones, and a drain on one gateway moves sessions for both gateways sharing Redis, with no error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.processes import free_port
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.demo.workload import Conversation, multi_turn
from tests.conftest import require_binary

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
TOKEN = "e2e-admin-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _token_file(directory: Path) -> str:
    path = directory / "admin-token"
    path.write_text(TOKEN)
    return str(path)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    require_binary("envoy")
    token = _token_file(tmp_path_factory.mktemp("admin"))
    with LocalGateway(replicas=3, time_scale=0.02, processor_args=("--admin-token-file", token)) as gw:
        yield gw


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    require_binary("envoy")
    require_binary("redis-server")
    token = _token_file(tmp_path_factory.mktemp("admin-shared"))
    redis_port = free_port()
    url = f"redis://127.0.0.1:{redis_port}?namespace=admin-e2e"
    gw = LocalGateway(
        replicas=3, time_scale=0.02, processors=2, processor_args=("--store", url, "--admin-token-file", token)
    )
    redis = LocalRedis(gw.procs, gw.dir, port=redis_port)
    try:
        redis.start()
        gw.start()
        yield gw
    finally:
        gw.stop()  # Redis is in the gateway's process group: stopped by PID with the rest


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def body_of(conv: Conversation, turn: int) -> bytes:
    return json.dumps({"model": "demo-model", "messages": conv.next_messages(turn), "max_tokens": 2}).encode()


async def send(http: aiohttp.ClientSession, gw: LocalGateway, conv: Conversation, turn: int) -> tuple[int, str]:
    headers = {"x-session-id": conv.session_id, "content-type": "application/json"}
    async with http.post(gw.url + CHAT, data=body_of(conv, turn), headers=headers) as resp:
        payload = await resp.read()
        if resp.status == 200:
            conv.add_answer(json.loads(payload)["choices"][0]["message"]["content"])
        return resp.status, resp.headers.get("x-replica-name", "")


async def settled(stub: pb_grpc.AdminStub) -> None:
    """Wait until the replicas' scraped load stops changing (a request just ended changes it)."""
    previous = None
    for _ in range(40):
        reply = await stub.ListReplicas(pb.ListReplicasRequest())
        now = [(r.name, r.inflight, r.queue, round(r.kv_usage, 3)) for r in reply.replicas]
        if now == previous and all(r.inflight == 0 for r in reply.replicas):
            return
        previous = now
        await asyncio.sleep(0.3)  # real time: the real gateway's load settling


async def test_explain_agrees_with_where_the_request_goes(gateway: LocalGateway, http: aiohttp.ClientSession) -> None:
    convs = multi_turn(6, 3, seed=11, system_tokens=100, document_tokens=200, run_id="explain")
    async with grpc.aio.insecure_channel(gateway.admin_addresses[0]) as channel:
        stub = pb_grpc.AdminStub(channel)
        watch = stub.WatchDecisions(pb.WatchRequest(sample_rate=1.0))
        reasons = set()
        for turn in range(3):
            for conv in convs:
                await settled(stub)
                headers = [pb.Header(key=":path", value=CHAT), pb.Header(key="x-session-id", value=conv.session_id)]
                explained = await stub.Explain(pb.ExplainRequest(headers=headers, body=body_of(conv, turn)))
                status, replica = await send(http, gateway, conv, turn)
                assert status == 200
                assert replica == explained.replica, (conv.session_id, turn, explained)
                event = await asyncio.wait_for(watch.read(), 10)
                assert (event.replica, event.reason) == (explained.replica, explained.reason)
                reasons.add(explained.reason)
        watch.cancel()
    assert {"new_session", "sticky"} <= reasons


async def test_a_cordoned_replica_keeps_its_sessions_and_gets_no_new_one(
    gateway: LocalGateway, http: aiohttp.ClientSession
) -> None:
    first = multi_turn(6, 4, seed=12, system_tokens=50, document_tokens=100, run_id="cordon-old")
    placed = {}
    for conv in first:
        status, placed[conv.session_id] = await send(http, gateway, conv, 0)
        assert status == 200
    victim = max(set(placed.values()), key=list(placed.values()).count)
    async with grpc.aio.insecure_channel(gateway.admin_addresses[0]) as channel:
        stub = pb_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Cordon(pb.ReplicaRequest(replica=victim))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await stub.Cordon(pb.ReplicaRequest(replica=victim), metadata=AUTH)).cordon == "cordoned"
        try:
            fresh = multi_turn(12, 1, seed=13, system_tokens=50, document_tokens=100, run_id="cordon-new")
            for conv in fresh:
                status, replica = await send(http, gateway, conv, 0)
                assert status == 200 and replica != victim
            for turn in (1, 2):
                for conv in first:
                    status, replica = await send(http, gateway, conv, turn)
                    assert status == 200 and replica == placed[conv.session_id]
        finally:
            await stub.Uncordon(pb.ReplicaRequest(replica=victim), metadata=AUTH)


async def test_a_drain_moves_sessions_on_two_gateways_sharing_redis(
    shared: LocalGateway, http: aiohttp.ClientSession
) -> None:
    convs = multi_turn(12, 6, seed=14, system_tokens=100, document_tokens=200, run_id="drain")
    placed: dict[str, str] = {}
    for turn in (0, 1):  # turns alternate the two processors (Envoy round-robins the streams)
        for conv in convs:
            status, placed[conv.session_id] = await send(http, shared, conv, turn)
            assert status == 200
    victim = max(set(placed.values()), key=list(placed.values()).count)
    on_victim = [c for c in convs if placed[c.session_id] == victim]
    assert on_victim
    async with (
        grpc.aio.insecure_channel(shared.admin_addresses[0]) as a,
        grpc.aio.insecure_channel(shared.admin_addresses[1]) as b,
    ):
        drained = await pb_grpc.AdminStub(a).Drain(pb.ReplicaRequest(replica=victim), metadata=AUTH)
        assert drained.cordon == "drained" and drained.sessions_moved > 0
        other = pb_grpc.AdminStub(b)
        for _ in range(50):  # the other gateway reads cordons from Redis after each health round
            states = {r.name: r.cordon for r in (await other.ListReplicas(pb.ListReplicasRequest())).replicas}
            if states[victim] == "drained":
                break
            await asyncio.sleep(0.1)  # real time: the other gateway reads Redis after its health round
        assert states[victim] == "drained"
        # Near-caches hold a pin for up to a second: let the moved pins be what both gateways read.
        await asyncio.sleep(1.2)
        later: dict[str, set[str]] = {c.session_id: set() for c in convs}
        for turn in (2, 3, 4, 5):
            for conv in convs:
                status, replica = await send(http, shared, conv, turn)
                assert status == 200, (conv.session_id, turn)
                assert replica != victim
                later[conv.session_id].add(replica)
        for conv in convs:
            assert len(later[conv.session_id]) == 1, (conv.session_id, later[conv.session_id])
            if conv not in on_victim:
                assert later[conv.session_id] == {placed[conv.session_id]}
        await pb_grpc.AdminStub(a).Uncordon(pb.ReplicaRequest(replica=victim), metadata=AUTH)
