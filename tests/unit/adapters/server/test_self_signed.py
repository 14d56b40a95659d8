"""TLS without a certificate to give: the ext_proc port serves a self-signed one made at start
(``grpc.secure_serving``, on by default when following an InferencePool, as GIE's picker)."""

from __future__ import annotations

import argparse

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.server.app import ProcessorServer
from extproc.adapters.server.self_signed import self_signed_pair, serves_self_signed
from extproc.app.router import Router
from extproc.config.cli_flags import add_config_flags, config_from_flags
from tests.conftest import make_config


def test_the_certificate_names_loopback_and_the_host() -> None:
    cert, key = self_signed_pair(("picker.team-a.svc",))
    assert b"PRIVATE KEY" in key
    parsed = x509.load_pem_x509_certificate(cert)
    sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "picker.team-a.svc"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert parsed.issuer == parsed.subject  # self-signed


def test_secure_serving_is_the_pickers_default() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)

    def decided(*argv: str, env: dict[str, str] | None = None) -> bool:
        cfg = config_from_flags(None, parser.parse_args(list(argv)), environ=env or {})
        return serves_self_signed(cfg.grpc.tls is not None, cfg.grpc.secure_serving, cfg.discovery.type, cfg.listen)

    assert decided("--pool-name", "vllm") is True
    assert decided("--pool-name", "vllm", "--secure-serving", "false") is False
    assert decided("--pool-name", "vllm", env={"EXTPROC_GRPC__SECURE_SERVING": "off"}) is False
    assert decided("--replica", "a=10.0.0.1:8000") is False
    assert decided("--replica", "a=10.0.0.1:8000", "--secure-serving", "true") is True
    assert decided("--pool-name", "vllm", "--listen", "unix:/run/extproc.sock") is False
    # Files given: those are served, nothing is made.
    assert serves_self_signed(True, True, "inference_pool", "0.0.0.0:9002") is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--secure-serving", "maybe"])


@pytest.mark.parametrize("kind", ["grpcio", "grpclib"])
async def test_the_listener_serves_tls_with_the_certificate_it_made_and_refuses_plaintext(kind: str) -> None:
    server = ProcessorServer(Router(make_config()), "127.0.0.1:0", self_signed=True, server=kind)
    await server.start()
    try:
        assert server.self_signed_cert is not None
        trusting = grpc.ssl_channel_credentials(root_certificates=server.self_signed_cert)
        async with grpc.aio.secure_channel(server.address, trusting) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
