"""The admin API on a real gRPC listener: reads, refused and authorised mutations, the CLI."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.admin.server import AdminServer
from extproc.config import AdminSettings
from extproc.router import Router
from tests.conftest import chat_body, make_config

TOKEN = "s3cret-admin-token"
CHAT = "/v1/chat/completions"
MUTATIONS = ("ForgetSession", "Cordon", "Uncordon", "Drain")


async def _admin(router: Router, settings: AdminSettings) -> AdminServer:
    server = AdminServer(router, replace(settings, listen="127.0.0.1:0"))
    await server.bind()
    await server.start()
    return server


@pytest.fixture
async def router() -> Router:
    return Router(make_config())


@pytest.fixture
async def with_token(router: Router, tmp_path: Path) -> AsyncIterator[AdminServer]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = await _admin(router, AdminSettings(token_file=str(token_file)))
    yield server
    await server.close(0)


def _mutation(stub: pb_grpc.AdminStub, name: str) -> tuple[object, object]:
    if name == "ForgetSession":
        return stub.ForgetSession, pb.SessionRequest(session_key="s", model="m")
    return getattr(stub, name), pb.ReplicaRequest(replica="r0")


async def test_without_a_token_configured_every_mutation_is_refused(router: Router) -> None:
    server = await _admin(router, AdminSettings())
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.AdminStub(channel)
            for name in MUTATIONS:
                call, request = _mutation(stub, name)
                for metadata in ((), (("authorization", f"Bearer {TOKEN}"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(request, metadata=metadata)  # type: ignore[operator]
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert router.cordons == {} and await router.store.cordons() == {}
            replies = await stub.ListReplicas(pb.ListReplicasRequest())  # reading stays open
            assert [r.name for r in replies.replicas] == ["r0", "r1", "r2"]
    finally:
        await server.close(0)


async def test_a_missing_or_wrong_token_is_refused_and_the_right_one_works(
    router: Router, with_token: AdminServer
) -> None:
    async with grpc.aio.insecure_channel(with_token.address) as channel:
        stub = pb_grpc.AdminStub(channel)
        for name in MUTATIONS:
            call, request = _mutation(stub, name)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(request, metadata=metadata)  # type: ignore[operator]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
        assert router.cordons == {}
        good = (("authorization", f"Bearer {TOKEN}"),)
        reply = await stub.Cordon(pb.ReplicaRequest(replica="r1"), metadata=good)
        assert reply.cordon == "cordoned" and router.cordons == {"r1": "cordoned"}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Drain(pb.ReplicaRequest(replica="nope"), metadata=good)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        listed = {r.name: r.cordon for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}
        assert listed["r1"] == "cordoned"
        assert (await stub.Uncordon(pb.ReplicaRequest(replica="r1"), metadata=good)).cordon == ""


async def test_explain_and_sessions_over_the_api(router: Router, with_token: AdminServer) -> None:
    body = chat_body("tell me about caches " * 30)
    routed = await router.route({":path": CHAT, "x-session-id": "sess-1"}, body)
    async with grpc.aio.insecure_channel(with_token.address) as channel:
        stub = pb_grpc.AdminStub(channel)
        headers = [pb.Header(key=":path", value=CHAT), pb.Header(key="x-session-id", value="sess-1")]
        reply = await stub.Explain(pb.ExplainRequest(headers=headers, body=body))
        assert reply.replica == routed.decision.replica.name == reply.pinned  # type: ignore[union-attr]
        assert reply.reason == "sticky" and reply.order[0] == reply.replica
        chosen = next(r for r in reply.replicas if r.replica == reply.replica)
        assert chosen.rank == 0 and chosen.match_source == "estimate" and chosen.matched_blocks > 0
        assert abs(sum(p.contribution for p in chosen.scores) - chosen.total) < 1e-9
        assert {p.scorer for p in chosen.scores} >= {"session_affinity", "prefix", "load"}
        session = await stub.GetSession(pb.SessionRequest(session_key="sess-1", model="m"))
        assert session.replica == reply.replica
        good = (("authorization", f"Bearer {TOKEN}"),)
        assert (await stub.ForgetSession(pb.SessionRequest(session_key="sess-1", model="m"), metadata=good)).forgotten
        assert (await stub.GetSession(pb.SessionRequest(session_key="sess-1", model="m"))).replica == ""


async def test_the_cli_prints_tables_and_json(router: Router, with_token: AdminServer, tmp_path: Path) -> None:
    body_file = tmp_path / "body.json"
    body_file.write_bytes(chat_body("hello"))
    token_file = tmp_path / "token"  # written by the fixture

    async def cli(*argv: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "admin", "--server", with_token.address, *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    rc, out, _ = await cli("explain", "--body", str(body_file), "--header", "x-session-id:abc")
    assert rc == 0 and "REPLICA" in out and "reason new_session" in out
    rc, out, _ = await cli("--json", "replicas")
    assert rc == 0 and [r["name"] for r in json.loads(out)["replicas"]] == ["r0", "r1", "r2"]
    rc, _, err = await cli("cordon", "r2")
    assert rc == 1 and "UNAUTHENTICATED" in err and router.cordons == {}
    rc, out, _ = await cli("--token-file", str(token_file), "drain", "r2")
    assert rc == 0 and "r2: drained" in out and router.cordons == {"r2": "drained"}
