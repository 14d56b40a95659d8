"""The real gRPC server on a free port, with a real channel: ext_proc, health, reflection; each
test that both servers must pass runs on grpcio's and on grpclib's (``grpc.server``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from extproc.adapters.server import ProcessorServer
from extproc.app.router import Router
from tests.conftest import body_message, chat_body, headers_message, make_config, set_headers
from tests.helpers import wait_for

SERVERS = ("grpcio", "grpclib")


@pytest.fixture(params=SERVERS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[ProcessorServer]:
    srv = ProcessorServer(
        Router(make_config()), "127.0.0.1:0", max_message_bytes=32 * 1024 * 1024, server=request.param
    )
    await srv.start()
    yield srv
    await srv.stop(0.5)


async def test_process_stream_over_a_real_channel(server: ProcessorServer) -> None:
    async with grpc.aio.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
    ) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        big = chat_body("x" * (6 * 1024 * 1024))  # over gRPC's 4 MiB default
        call = stub.Process(
            iter([headers_message({":path": "/v1/chat/completions", "x-session-id": "s"}), body_message(big)])
        )
        responses = [r async for r in call]
    assert len(responses) == 2
    assert set_headers(responses[1].request_body.response.header_mutation)["x-target-cluster"]


async def test_health_and_reflection(server: ProcessorServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension", "liveness"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        if server.kind == "grpclib":
            return  # no reflection on grpclib (grpclib_server.py)
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in call for s in r.list_services_response.service]
        assert "envoy.service.ext_proc.v3.ExternalProcessor" in names


async def test_graceful_stop_reports_not_serving_first(server: ProcessorServer) -> None:
    await server.health.set("", health_pb2.HealthCheckResponse.SERVING)
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        second = await watch.read()
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


@pytest.mark.parametrize("kind", SERVERS)
async def test_unix_socket_listener(tmp_path: object, kind: str) -> None:
    path = f"unix:{tmp_path}/extproc.sock"
    srv = ProcessorServer(Router(make_config()), path, server=kind)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(path) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            call = pb_grpc.ExternalProcessorStub(channel).Process(
                iter([headers_message({":path": "/v1/models"}, end_of_stream=True)])
            )
            out = [r async for r in call]
            assert isinstance(out[0], pb.ProcessingResponse)
    finally:
        await srv.stop(0.5)


@pytest.mark.parametrize("kind", SERVERS)
async def test_with_discovery_pending_ext_proc_is_not_serving_until_a_replica_is_known(kind: str) -> None:
    import asyncio

    from extproc.routing import Replica

    router = Router(make_config(replicas=()))
    server = ProcessorServer(router, "127.0.0.1:0", server=kind)
    await server.start(ready_when=lambda: len(router.replicas) > 0, ready_timeout_s=30)
    service = "envoy.service.ext_proc.v3.ExternalProcessor"
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                return int((await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=3)).status)

            assert await status("") == health_pb2.HealthCheckResponse.SERVING  # alive
            assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready
            await router.fleet.set_replicas([Replica("r0", "127.0.0.1:8000")])
            for _ in range(30):
                if await status(service) == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)  # real time: readiness read over a real gRPC health service
            assert await status(service) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_a_discovery_that_never_answers_still_ends_in_serving() -> None:
    server = ProcessorServer(Router(make_config(replicas=())), "127.0.0.1:0")
    await server.start(ready_when=lambda: False, ready_timeout_s=0.3)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            service = "envoy.service.ext_proc.v3.ExternalProcessor"

            async def serving() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            await wait_for(serving, "SERVING after the ready timeout", within_s=5.0, step_s=0.05)  # Envoy fails open
    finally:
        await server.stop(0)


async def test_a_stream_reset_after_the_decision_releases_its_in_flight_slot(server: ProcessorServer) -> None:
    # Envoy resets the stream when the client goes away: the servicer is cancelled wherever it
    # waits (reading the next message, or writing an answer), and the request's slot must be freed.
    router = server.router
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_message({":path": "/v1/chat/completions", "x-session-id": "s"}))
        await call.read()
        await call.write(body_message(chat_body("hello " * 100)))
        decided = await call.read()
        assert set_headers(decided.request_body.response.header_mutation)["x-target-cluster"]
        assert sum(r.inflight for r in router.replicas.records()) == 1
        call.cancel()
        await wait_for(lambda: all(r.inflight == 0 for r in router.replicas.records()), "the slot released")


async def test_health_watch_on_the_health_port_follows_the_same_statuses() -> None:
    srv = ProcessorServer(Router(make_config()), "127.0.0.1:0", health_listen="127.0.0.1:0", server="grpclib")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="later"))
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            await srv.health.set("later", health_pb2.HealthCheckResponse.SERVING)
            assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVING
            unknown.cancel()
            with pytest.raises(grpc.aio.AioRpcError):  # the health port serves health alone
                await pb_grpc.ExternalProcessorStub(channel).Process(iter([headers_message({})])).read()
    finally:
        await srv.stop(0)


async def test_on_grpclib_a_stop_lets_a_stream_in_flight_finish_within_its_grace() -> None:
    srv = ProcessorServer(Router(make_config()), "127.0.0.1:0", server="grpclib")
    await srv.start()
    async with grpc.aio.insecure_channel(srv.address) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_message({":path": "/v1/chat/completions", "x-session-id": "s"}))
        await call.read()
        stopping = asyncio.create_task(srv.stop(5.0))
        await asyncio.sleep(0.2)  # real time: the stop waits on a real gRPC stream
        assert not stopping.done()  # waiting for the stream
        await call.write(body_message(chat_body("hello")))
        decided = await call.read()
        assert set_headers(decided.request_body.response.header_mutation)["x-target-cluster"]
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await asyncio.wait_for(stopping, 3)
