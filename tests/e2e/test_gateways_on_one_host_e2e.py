"""Two gateways on one host, as a user ran them: each an Envoy and an ``extproc serve`` with only
its own --listen and --metrics-listen (no admin flag), both on one real Redis and the same
replicas. Both start, every request through either is answered, a conversation keeps its
replica whichever gateway each turn goes through, and each processor's admin API answers on
its own ext_proc port (the second processor used to exit on the admin API's default port)."""

from __future__ import annotations

import json
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def gateways() -> Iterator[tuple[LocalGateway, LocalGateway]]:
    require_binary("envoy")
    require_binary("redis-server")
    redis_port = free_port()
    store = ("--store", f"redis://127.0.0.1:{redis_port}?namespace=one-host")
    first = LocalGateway(replicas=3, time_scale=0.02, processor_args=store)
    second = LocalGateway(replicas=3, time_scale=0.02, processor_args=store)
    second.members = first.members  # the same replicas behind both gateways
    redis = LocalRedis(first.procs, first.dir, port=redis_port)
    try:
        redis.start()
        first.start()
        second.start_processor()  # its own --listen and --metrics-listen; no --admin-listen
        second.start_envoy()
        yield first, second
    finally:
        second.stop()
        first.stop()  # Redis and the replicas are in the first gateway's process group


async def _send(http: aiohttp.ClientSession, gw: LocalGateway, conv: Conversation, turn: int) -> tuple[int, str]:
    body = json.dumps({"model": "demo-model", "messages": conv.next_messages(turn), "max_tokens": 2})
    headers = {"x-session-id": conv.session_id, "content-type": "application/json"}
    async with http.post(gw.url + CHAT, data=body, headers=headers) as resp:
        payload = await resp.read()
        if resp.status == 200:
            conv.add_answer(json.loads(payload)["choices"][0]["message"]["content"])
        return resp.status, resp.headers.get("x-replica-name", "")


async def test_two_gateways_on_one_host_serve_every_request_with_sticky_sessions(
    gateways: tuple[LocalGateway, LocalGateway],
) -> None:
    first, second = gateways
    for gw in gateways:
        argv = gw.procs.procs["processor"].args
        assert isinstance(argv, list) and "--admin-listen" not in argv  # the default: admin on the ext_proc port
    convs = multi_turn(12, 4, seed=24, system_tokens=100, document_tokens=200, run_id="one-host")
    placed: dict[str, set[str]] = {c.session_id: set() for c in convs}
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for turn in range(4):
            for i, conv in enumerate(convs):
                gw = (first, second)[(i + turn) % 2]  # each conversation alternates the gateways
                status, replica = await _send(http, gw, conv, turn)
                statuses.append(status)
                placed[conv.session_id].add(replica)
    assert statuses == [200] * 48
    assert all(len(replicas) == 1 and "" not in replicas for replicas in placed.values()), placed
    # Each processor's admin API, where `extproc admin --server <its --listen>` finds it; both
    # read the pins from the one Redis.
    for gw in gateways:
        async with grpc.aio.insecure_channel(gw.admin_addresses[0]) as channel:
            stub = pb_grpc.AdminStub(channel)
            listed = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
            assert sorted(r.name for r in listed.replicas) == sorted(m.name for m in first.members)
            for conv in convs[:4]:
                pinned = await stub.GetSession(pb.SessionRequest(session_key=conv.session_id, model="demo-model"))
                assert {pinned.replica} == placed[conv.session_id]
