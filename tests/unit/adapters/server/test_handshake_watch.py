"""TLS handshake failures told: gRPC core's own log line read, counted, and reported with its cause."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from extproc.adapters.server.handshake_watch import HandshakeWatch

CORE_FAILURE = (
    b"I1205 00:06:21.209078   31540 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: "
    b"error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context"
)


def test_a_stderr_already_redirected_in_python_is_left_alone() -> None:
    # Under pytest sys.stderr is the capture's: main() called in-process must not take it over.
    assert sys.stderr is not sys.__stderr__
    before = os.environ.get("GRPC_VERBOSITY")
    assert HandshakeWatch(lambda reason: None).start() is False
    assert os.environ.get("GRPC_VERBOSITY") == before


def test_the_cores_lines_are_read_counted_dropped_or_passed_on() -> None:
    failures: list[str] = []
    watch = HandshakeWatch(failures.append)
    read, write = os.pipe()
    watch._out = write
    watch.line(CORE_FAILURE)
    watch.line(b"I1205 00:06:21.209078   31540 chttp2_transport.cc:1937] some core chatter")
    watch.line(b"E1205 00:06:21.209078   31540 server.cc:12] a core error stays")
    watch.line(b"an ordinary line")
    os.close(write)
    with os.fdopen(read, "rb") as passed:
        out = passed.read()
    assert failures == ["WRONG_VERSION_NUMBER"]
    assert out == b"E1205 00:06:21.209078   31540 server.cc:12] a core error stays\nan ordinary line\n"


SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, sys
    from extproc.base.logs import setup_logging
    from extproc.adapters.server.handshake_watch import HandshakeWatch

    setup_logging("info", "text")
    failures = []
    assert HandshakeWatch(failures.append).start()

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from extproc.adapters.server.self_signed import self_signed_pair

    async def main():
        cert, key = self_signed_pair(("localhost",))
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext to the TLS port
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                pass
        for _ in range(50):
            if failures:
                break
            await asyncio.sleep(0.05)  # real time: the failed handshakes reach the real gRPC server
        await server.stop(0)
        print("failures", " ".join(failures), flush=True)
        print("after the watch, python's stderr", file=sys.stderr, flush=True)

    asyncio.run(main())
    """
)


def test_a_plaintext_client_on_a_tls_port_is_counted_and_told_with_its_cause() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split()[:2] == ["failures", "WRONG_VERSION_NUMBER"], done
    assert "TLS handshake failed on a TLS port of this router (WRONG_VERSION_NUMBER)" in done.stderr
    assert "most likely a client speaking plaintext to this TLS port" in done.stderr
    assert "ssl_transport_security.cc" not in done.stderr  # the core's INFO line itself is not passed on
    assert "after the watch, python's stderr" in done.stderr
