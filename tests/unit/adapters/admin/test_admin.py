"""The admin API on a real gRPC listener: reads, refused and authorised mutations, the CLI, and
where it is served (the ext_proc port by default)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.adapters.admin import client as admin_client
from extproc.adapters.admin.client import add_parser as add_admin_parser
from extproc.adapters.admin.server import AdminServer, place_admin
from extproc.adapters.server import ProcessorServer
from extproc.app.router import Router
from extproc.config import AdminSettings, ConfigError, ListenerTls, config_from_mapping
from extproc.config.cli_flags import add_config_flags, config_from_flags
from tests.conftest import chat_body, make_config

TOKEN = "s3cret-admin-token"
CHAT = "/v1/chat/completions"
MUTATIONS = ("ForgetSession", "Cordon", "Uncordon", "Drain")


async def _admin(router: Router, settings: AdminSettings) -> AdminServer:
    server = AdminServer(router, settings.model_copy(update={"listen": "127.0.0.1:0"}))
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


# --- where the admin API is served (docs/ports.md) ----------------------------------------------


@asynccontextmanager
async def ext_proc_port_with_admin(router: Router) -> AsyncIterator[str]:
    """A processor on a loopback port with the admin API placed as ``router.config`` says."""
    placement = place_admin(router)
    assert placement.listeners == []  # nothing of its own: it shares the ext_proc port
    server = ProcessorServer(router, "127.0.0.1:0", services=placement.services)
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop(0)


async def test_by_default_the_admin_api_is_a_service_of_the_ext_proc_port() -> None:
    router = Router(make_config())  # listen 127.0.0.1:9002, no admin settings
    assert router.config.admin.enabled and router.config.admin.listen is None
    async with ext_proc_port_with_admin(router) as address, grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # the same port serves both
        stub = pb_grpc.AdminStub(channel)
        replies = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=5)  # loopback: reading is open
        assert [r.name for r in replies.replicas] == ["r0", "r1", "r2"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Cordon(pb.ReplicaRequest(replica="r0"), metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # no token configured: no mutation
        assert router.cordons == {}


async def test_on_an_ext_proc_port_off_loopback_every_admin_call_needs_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    # The policy follows the configured listener; the test serves it on loopback all the same.
    router = Router(make_config(listen="0.0.0.0:9002", admin=AdminSettings(token_file=str(token_file))))
    good = (("authorization", f"Bearer {TOKEN}"),)
    async with ext_proc_port_with_admin(router) as address, grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.AdminStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListReplicas(pb.ListReplicasRequest(), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetSession(pb.SessionRequest(session_key="s"), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            watch = stub.WatchDecisions(pb.WatchRequest(sample_rate=1.0), metadata=metadata, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len((await stub.ListReplicas(pb.ListReplicasRequest(), metadata=good, timeout=5)).replicas) == 3
        assert (await stub.Cordon(pb.ReplicaRequest(replica="r2"), metadata=good, timeout=5)).cordon == "cordoned"


async def test_on_an_ext_proc_port_off_loopback_without_a_token_there_is_no_admin_api(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level("WARNING", "extproc.adapters.admin")
    router = Router(make_config(listen="0.0.0.0:9002"))
    assert place_admin(router).services == []
    assert any("admin API not served" in r.getMessage() and "0.0.0.0:9002" in r.getMessage() for r in caplog.records)
    async with ext_proc_port_with_admin(router) as address:
        parser = argparse.ArgumentParser()
        add_admin_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["admin", "--server", address, "replicas"])
        assert await admin_client._run(args, (), b"", io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "UNIMPLEMENTED" in err and f"no admin API on {address}" in err and "docs/ports.md" in err


async def test_the_admin_api_goes_where_the_config_says() -> None:
    own = place_admin(Router(make_config(admin=AdminSettings(listen="127.0.0.1:0"))))
    assert [type(x) for x in own.listeners] == [AdminServer] and own.services == []
    off = place_admin(Router(make_config(admin=AdminSettings(enabled=False))))
    assert off.listeners == [] and off.services == []
    same = place_admin(Router(make_config(listen="127.0.0.1:9002", admin=AdminSettings(listen="127.0.0.1:9002"))))
    assert same.listeners == [] and len(same.services) == 1  # its own port named as ext_proc's: shared
    tls = ListenerTls(cert_file="cert.pem", key_file="key.pem")
    with pytest.raises(ValueError, match="separate admin listener"):  # it would be ignored on the ext_proc port
        AdminSettings(tls=tls)
    with pytest.raises(ValueError, match=r"admin\.tls"):  # its own port named as ext_proc's: ignored too
        place_admin(Router(make_config(listen="127.0.0.1:9002", admin=AdminSettings(listen="127.0.0.1:9002", tls=tls))))


def test_admin_settings_from_yaml_and_flags() -> None:
    assert config_from_mapping({}).admin == AdminSettings()
    assert config_from_mapping({"admin": {"listen": "127.0.0.1:9191"}}).admin.listen == "127.0.0.1:9191"
    assert not config_from_mapping({"admin": {"listen": "off"}}).admin.enabled
    assert not config_from_mapping({"admin": {"enabled": False}}).admin.enabled
    with pytest.raises(ConfigError, match=r"admin\.tls"):
        config_from_mapping({"admin": {"tls": {"cert_file": "c.pem", "key_file": "k.pem"}}})
    parser = argparse.ArgumentParser()
    add_config_flags(parser)

    def flags(*argv: str) -> AdminSettings:
        return config_from_flags(None, parser.parse_args(["--replica", "r0=127.0.0.1:9", *argv])).admin

    assert flags() == AdminSettings()
    assert flags("--admin-listen", "off") == AdminSettings(enabled=False)
    assert flags("--admin-listen", "127.0.0.1:7000").listen == "127.0.0.1:7000"
