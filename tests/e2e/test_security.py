"""Security defaults: loopback listeners, TLS and mutual TLS on the gRPC listener (certificates
reloaded from their files), Envoy's TLS to the processor, Redis over TLS with AUTH, secrets from
files, and logs at info level that hold no prompt, API key, session id or password.

Certificates are throwaway ones made with the ``openssl`` command line for each run. Client-set
routing headers are covered elsewhere: through Envoy with the processor up
(``tests/e2e/test_e2e.py::test_client_set_routing_headers_are_ignored``), stripped by Envoy before
ext_proc, so also when the processor is down
(``tests/unit/adapters/envoy_config/test_envoy_config.py::test_client_routing_headers_are_stripped_before_ext_proc``),
and removed again by the processor (``tests/unit/adapters/server/test_stream.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.cli import main
from extproc.adapters.envoy_config import GatewaySpec, ProcessorTls, render_yaml
from extproc.adapters.server import ProcessorServer
from extproc.app.router import Router
from extproc.config import Config, ConfigError, ListenerTls, config_from_mapping
from extproc.routing import Replica
from extproc.state.factory import open_store
from extproc.state.redis_store import RedisStore
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import chat_body, read_metrics, send, total
from extproc_lab.demo.processes import ProcessGroup, free_port, wait_for_port
from tests.conftest import body_message, headers_message, make_config, require_binary, set_headers
from tests.conftest import chat_body as stream_chat_body
from tests.helpers import deciding, validate

SERVER_NAME = "extproc.local"


# --- throwaway certificates ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate it signed (SANs extproc.local and 127.0.0.1), a client
    certificate it signed, and a second CA with a client certificate of its own (a stranger)."""

    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(directory: Path, name: str) -> None:
    """``name.pem`` and ``name.key``: a self-signed CA (P-256, one day)."""
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


def make_leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    """``name.pem`` and ``name.key``: a certificate signed by ``ca`` with ``extensions``."""
    (directory / f"{name}.ext").write_text(extensions + "\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


SERVER_EXT = f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\nextendedKeyUsage=serverAuth"
CLIENT_EXT = "subjectAltName=DNS:envoy.local\nextendedKeyUsage=clientAuth"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    require_binary("openssl")
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_leaf(directory, "server", "ca", SERVER_EXT)
    make_leaf(directory, "client", "ca", CLIENT_EXT)
    make_ca(directory, "stranger-ca")
    make_leaf(directory, "stranger", "stranger-ca", CLIENT_EXT)
    return Pki(directory)


# --- defaults --------------------------------------------------------------------------------


def test_every_listener_defaults_to_loopback() -> None:
    cfg = Config()
    assert cfg.listen == "127.0.0.1:9002" and cfg.metrics.address == "127.0.0.1:9190"
    assert cfg.grpc.tls is None  # plaintext is for loopback (or a unix socket); TLS is opt-in
    spec = GatewaySpec(replicas=[Replica("r", "127.0.0.1:8000")])
    assert spec.listen.startswith("127.0.0.1:") and spec.admin.startswith("127.0.0.1:")
    assert spec.processor.startswith("127.0.0.1:") and spec.processor_tls is None


async def test_a_plaintext_listener_off_loopback_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", "extproc.adapters.server")
    server = ProcessorServer(Router(make_config()), "0.0.0.0:0")
    try:
        assert any("not loopback and has no TLS" in r.getMessage() for r in caplog.records)
    finally:
        await server.stop(0)
    caplog.clear()
    server = ProcessorServer(Router(make_config()), "127.0.0.1:0")
    await server.stop(0)
    assert not caplog.records


# --- TLS and mTLS on the gRPC listener --------------------------------------------------------


SERVERS = ("grpcio", "grpclib")  # grpc.server: each TLS test holds for both


@pytest.fixture(params=SERVERS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def tls_server(pki: Pki, request: pytest.FixtureRequest, kind: str) -> AsyncIterator[ProcessorServer]:
    mutual = getattr(request, "param", False)
    tls = ListenerTls(
        cert_file=pki.path("server.pem"),
        key_file=pki.path("server.key"),
        client_ca_file=pki.path("ca.pem") if mutual else None,
    )
    server = ProcessorServer(Router(make_config()), "127.0.0.1:0", tls=tls, server=kind)
    await server.start()
    yield server
    await server.stop(0)


def credentials(pki: Pki, client: str | None = None, ca: str = "ca") -> grpc.ChannelCredentials:
    """Client credentials trusting ``ca``, presenting ``client``'s certificate when given."""
    return grpc.ssl_channel_credentials(
        root_certificates=pki.read(f"{ca}.pem"),
        private_key=pki.read(f"{client}.key") if client else None,
        certificate_chain=pki.read(f"{client}.pem") if client else None,
    )


async def health_check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return int(reply.status)


async def route_one(channel: grpc.aio.Channel) -> dict[str, str]:
    """One ext_proc stream over ``channel``: the routing headers of the body answer."""
    call = pb_grpc.ExternalProcessorStub(channel).Process(
        iter(
            [
                headers_message({":path": "/v1/chat/completions", "x-session-id": "tls"}),
                body_message(stream_chat_body("over tls")),
            ]
        ),
        timeout=3,
    )
    responses = [r async for r in call]
    return set_headers(responses[1].request_body.response.header_mutation)


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(channel)
    return info.value.code()


async def test_tls_listener_serves_tls_clients_and_refuses_plaintext(tls_server: ProcessorServer, pki: Pki) -> None:
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki)) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
        assert (await route_one(channel))["x-target-cluster"]  # a routed request over TLS
    # The server's certificate names extproc.local too: a client dialling by that name checks it.
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki), options=options) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(tls_server.address) as channel:
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki, ca="stranger-ca")) as channel:
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE  # a server it cannot verify


async def test_a_plaintext_health_port_beside_an_mtls_listener_serves_health_alone(pki: Pki, kind: str) -> None:
    """kubelet's gRPC probes speak plaintext: grpc.health_listen gives them the health service,
    with the status of the TLS listener, and nothing else."""
    tls = ListenerTls(
        cert_file=pki.path("server.pem"), key_file=pki.path("server.key"), client_ca_file=pki.path("ca.pem")
    )
    server = ProcessorServer(Router(make_config()), "127.0.0.1:0", tls=tls, health_listen="127.0.0.1:0", server=kind)
    await server.start()
    try:
        plain = f"127.0.0.1:{server.health_port}"
        async with grpc.aio.insecure_channel(plain) as channel:
            assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
            # No ext_proc in plaintext. The stream sends nothing: messages written while the server
            # answers UNIMPLEMENTED race its close, and the client then saw INTERNAL (once, in a full run).
            call = pb_grpc.ExternalProcessorStub(channel).Process(iter(()), timeout=3)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in call]
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, info.value
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE  # the main port stays TLS-only
        for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            await server.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        async with grpc.aio.insecure_channel(plain) as channel:
            assert await health_check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(0)


@pytest.mark.parametrize("tls_server", [True], indirect=True, ids=["mtls"])
async def test_mtls_requires_a_client_certificate_signed_by_the_client_ca(
    tls_server: ProcessorServer, pki: Pki
) -> None:
    assert tls_server.tls is not None and tls_server.tls.mutual
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki, client="client")) as channel:
        assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
        assert (await route_one(channel))["x-target-cluster"]
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki)) as channel:
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    async with grpc.aio.secure_channel(tls_server.address, credentials(pki, client="stranger")) as channel:
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE  # one from another CA


async def test_a_rotated_certificate_is_served_without_a_restart(pki: Pki, tmp_path: Path, kind: str) -> None:
    make_ca(tmp_path, "next-ca")
    make_leaf(tmp_path, "next", "next-ca", SERVER_EXT)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki.read("server.pem"))
    key.write_bytes(pki.read("server.key"))
    server = ProcessorServer(
        Router(make_config()), "127.0.0.1:0", tls=ListenerTls(cert_file=str(cert), key_file=str(key)), server=kind
    )
    await server.start()
    trusts_next = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "next-ca.pem").read_bytes())
    try:
        async with grpc.aio.secure_channel(server.address, trusts_next) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE  # still the old certificate
        # As a Secret update or cert-manager would: new files swapped in, the key first.
        for target, source in ((key, "next.key"), (cert, "next.pem")):
            staged = target.with_suffix(".new")
            staged.write_bytes((tmp_path / source).read_bytes())
            os.replace(staged, target)
        async with grpc.aio.secure_channel(server.address, trusts_next) as channel:
            assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
        assert server.certificates is not None and server.certificates.reloads == 1
    finally:
        await server.stop(0)


async def test_tls_settings_come_from_files_and_errors_name_the_field(pki: Pki, tmp_path: Path) -> None:
    cfg = config_from_mapping(
        {"grpc": {"tls": {"cert_file": "/c.pem", "key_file": "/k.pem", "client_ca_file": "/ca.pem"}}}
    )
    assert (
        cfg.grpc.tls == ListenerTls(cert_file="/c.pem", key_file="/k.pem", client_ca_file="/ca.pem")
        and cfg.grpc.tls.mutual
    )
    for tls, message in (
        ({"cert_file": "/c.pem"}, r"grpc\.tls\.key_file: Field required"),
        ({"cert_file": "/c.pem", "key_file": "/k.pem", "key": "-----BEGIN"}, r"grpc\.tls\.key: unknown key"),
        ("yes", r"grpc\.tls: Input should be .*ListenerTls"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from_mapping({"grpc": {"tls": tls}})
    with pytest.raises(ValueError, match=r"grpc\.tls\.key_file: cannot read"):
        ProcessorServer(
            Router(make_config()),
            "127.0.0.1:0",
            tls=ListenerTls(cert_file=pki.path("server.pem"), key_file="/nope.key"),
        )
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=r"grpc\.tls\.cert_file: .* holds no PEM block"):
        ProcessorServer(
            Router(make_config()),
            "127.0.0.1:0",
            tls=ListenerTls(cert_file=str(not_pem), key_file=pki.path("server.key")),
        )


def test_serve_with_an_unreadable_key_exits_2(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--replica", "a=127.0.0.1:1", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", "off"]
    assert main([*argv, "--tls-cert", pki.path("server.pem"), "--tls-key", "/missing.key"]) == 2
    assert "grpc.tls.key_file: cannot read /missing.key" in capsys.readouterr().err
    assert main([*argv, "--tls-client-ca", pki.path("ca.pem")]) == 2  # mTLS needs a certificate
    assert "--tls-cert and --tls-key" in capsys.readouterr().err


# --- Envoy's side ------------------------------------------------------------------------------


def test_envoy_tls_and_mtls_to_the_processor_validate(pki: Pki, tmp_path: Path) -> None:
    replicas = [Replica("r0", "127.0.0.1:8000"), Replica("r1", "127.0.0.1:8001")]
    for tls in (
        ProcessorTls(pki.path("ca.pem")),
        ProcessorTls(pki.path("ca.pem"), pki.path("client.pem"), pki.path("client.key"), SERVER_NAME),
    ):
        path = tmp_path / "envoy.yaml"
        path.write_text(render_yaml(GatewaySpec(replicas=replicas, processor_tls=tls)))
        validate(path)


def test_envoy_config_cli_renders_processor_tls(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["envoy-config", "--replica", "a=127.0.0.1:8001", "--processor-ca", pki.path("ca.pem")]
    mtls = ["--processor-cert", pki.path("client.pem"), "--processor-key", pki.path("client.key")]
    assert main([*argv, *mtls, "--processor-server-name", SERVER_NAME]) == 0
    out = capsys.readouterr().out
    assert "envoy.transport_sockets.tls" in out and f"sni: {SERVER_NAME}" in out and "- h2" in out
    assert main([*argv, "--processor-cert", pki.path("client.pem")]) == 2  # a certificate without its key
    assert main(["envoy-config", "--replica", "a=127.0.0.1:8001", "--processor-server-name", "x"]) == 2  # no CA


@pytest.mark.e2e
async def test_envoy_routes_through_a_processor_that_requires_mtls(pki: Pki, kind: str) -> None:
    require_binary("envoy")
    tls_flags = ("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"), f"--grpc-server={kind}")
    if kind == "grpclib":
        tls_flags += ("--admin-listen=off",)
    envoy_tls = ProcessorTls(pki.path("ca.pem"), pki.path("client.pem"), pki.path("client.key"), SERVER_NAME)
    with LocalGateway(
        replicas=2,
        time_scale=0.02,
        processor_args=(*tls_flags, "--tls-client-ca", pki.path("ca.pem")),
        envoy_options={"processor_tls": envoy_tls},
    ) as gw:
        async with aiohttp.ClientSession() as http:
            # One conversation: each turn resends the last one's prompt and adds to it (a pin is worth
            # the cache behind it, so turns that shared nothing would not have to stay).
            prompts = ["mtls conversation " * 30 + " ".join(f"turn {i}" for i in range(t + 1)) for t in range(6)]
            outcomes = [await send(http, gw.url, "mtls-session", t, chat_body(p)) for t, p in enumerate(prompts)]
            decided = total(await read_metrics(http, gw.metrics_url), "extproc_decisions_total")
        log = (gw.dir / "processor.log").read_text()
    assert all(o.ok for o in outcomes) and len({o.replica for o in outcomes}) == 1, outcomes
    # Envoy fails open, so a TLS mistake would still answer 200: the decisions show routing happened.
    assert decided == 6, decided
    assert "mutual TLS" in log


# --- Redis AUTH over TLS ---------------------------------------------------------------------


async def test_redis_over_tls_with_a_password_from_a_file(pki: Pki, tmp_path: Path) -> None:
    binary = require_binary("redis-server")
    port = free_port()
    secret = tmp_path / "redis-password"
    secret.write_text("tls-s3cret\n")
    argv = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--tls-cert-file", pki.path("server.pem"), "--tls-key-file", pki.path("server.key"),
        "--tls-ca-cert-file", pki.path("ca.pem"), "--tls-auth-clients", "yes", "--requirepass", "tls-s3cret",
        "--dir", str(tmp_path),
    ]  # fmt: skip
    with ProcessGroup(tmp_path) as procs:
        proc = procs.start("redis-tls", argv)
        wait_for_port("127.0.0.1", port, proc=proc)
        options = (
            f"ssl_ca_certs={pki.path('ca.pem')}&ssl_certfile={pki.path('client.pem')}"
            f"&ssl_keyfile={pki.path('client.key')}&password_file={secret}&connect_timeout=1&socket_timeout=1"
        )
        store = open_store(f"rediss://127.0.0.1:{port}?{options}&namespace=tls")
        assert isinstance(store, RedisStore)
        try:
            await store.record("s-1", "r1", [1, 2], now=0.0, pin=True, model="m")
            assert await store.flush(3.0)
            fresh = open_store(f"rediss://127.0.0.1:{port}?{options}&namespace=tls&near_cache_ttl=0")
            try:
                view = await fresh.lookup("s-1", [1, 2], now=1.0, model="m")
            finally:
                await fresh.close()
            assert view.pinned == "r1" and dict(view.prefix_matches) == {"r1": 2}
        finally:
            await store.close()
        # Without a client certificate the server refuses the handshake: the store routes on without it.
        plain = open_store(f"rediss://127.0.0.1:{port}?ssl_ca_certs={pki.path('ca.pem')}&password_file={secret}")
        assert isinstance(plain, RedisStore)
        try:
            await plain.record("s-2", "r1", [3], now=0.0, pin=True, model="m")
            assert not await plain.flush(0.5)
        finally:
            await plain.close()


# --- what the logs hold ------------------------------------------------------------------------


CANARY = "PROMPT-CANARY-7f3c"
PROMPT = f"{CANARY} the secret plans for the harbor"
API_KEY = "sk-live-KEY-CANARY-91ab"
SESSION = "SESSION-CANARY-55d2"
PASSWORD = "PASSWORD-CANARY-0e1f"


@pytest.mark.e2e
async def test_info_logs_hold_no_prompt_key_session_or_password(tmp_path: Path) -> None:
    require_binary("envoy")
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    config = tmp_path / "router.yaml"
    config.write_text(f"tenants:\n  api_keys:\n    {digest}: acme\n")
    # Redis is not there: the store logs its outage (with the URL, redacted) and routes on.
    store = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}?namespace=logs"
    base = ("--config", str(config), "--store", store)
    with LocalGateway(replicas=2, time_scale=0.02, processor_args=(*base, "--log-level", "info")) as gw:

        async def traffic(http: aiohttp.ClientSession, tag: str) -> None:
            auth = {"authorization": f"Bearer {API_KEY}", "x-target-cluster": "replica-0"}  # forged, too
            for turn in range(3):
                body = chat_body(f"{PROMPT} turn {turn}")
                assert (await send(http, gw.url, f"{SESSION}-{tag}", turn, body, headers=auth)).ok
            bad = f'{{"messages": [{{"content": "{PROMPT}"'.encode()  # truncated JSON: a 400 from the replica
            assert (await send(http, gw.url, f"{SESSION}-{tag}", 9, bad, headers=auth)).status == 400
            streaming = json.dumps(
                {"model": "demo-model", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
            ).encode()
            assert (await send(http, gw.url, f"{SESSION}-{tag}", 10, streaming, headers=auth)).ok

        async with aiohttp.ClientSession() as http:
            await traffic(http, "text")
            # The same through a processor writing JSON lines.
            gw.procs.stop("processor")
            gw.processor_args = (*base, "--log-level", "info", "--log-format", "json")
            gw.start_processor()
            await deciding(http, gw)
            await traffic(http, "json")
        log = (gw.dir / "processor.log").read_text()
    assert "listening on" in log and "store URL carries its password inline" in log  # not an empty log
    assert '"level": "warning"' in log  # the JSON run logged too
    for secret in (CANARY, API_KEY, SESSION, PASSWORD, digest):
        assert secret not in log, secret


# --- the admin API -------------------------------------------------------------------------------


async def test_admin_over_mtls_authorises_mutations_by_client_certificate(pki: Pki) -> None:
    from extproc._proto.admin.v1 import admin_pb2 as admin_pb
    from extproc._proto.admin.v1 import admin_pb2_grpc as admin_grpc
    from extproc.adapters.admin.server import AdminServer
    from extproc.config import AdminSettings

    router = Router(make_config())
    tls = ListenerTls(
        cert_file=pki.path("server.pem"), key_file=pki.path("server.key"), client_ca_file=pki.path("ca.pem")
    )
    admin = AdminServer(router, AdminSettings(listen="127.0.0.1:0", tls=tls))
    await admin.bind()
    await admin.start()
    try:
        async with grpc.aio.secure_channel(admin.address, credentials(pki, "client")) as channel:
            reply = await admin_grpc.AdminStub(channel).Cordon(admin_pb.ReplicaRequest(replica="r0"), timeout=3)
            assert reply.cordon == "cordoned" and router.cordons == {"r0": "cordoned"}
        for creds in (credentials(pki), credentials(pki, "stranger")):  # no certificate, or the wrong CA's
            async with grpc.aio.secure_channel(admin.address, creds) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await admin_grpc.AdminStub(channel).Drain(admin_pb.ReplicaRequest(replica="r1"), timeout=3)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert router.cordons == {"r0": "cordoned"}
    finally:
        await admin.close(0)


def test_the_admin_api_defaults_to_the_loopback_ext_proc_port_and_refuses_mutations() -> None:
    from extproc.adapters.admin.auth import MutationPolicy

    cfg = Config()
    assert cfg.admin.enabled and cfg.admin.listen is None  # a service of the ext_proc port, loopback
    assert cfg.listen.startswith("127.0.0.1:") and cfg.admin.token_file is None and cfg.admin.tls is None
    verdict = MutationPolicy().check([("authorization", "Bearer anything")])
    assert not verdict.allowed and "disabled" in verdict.refused_because
