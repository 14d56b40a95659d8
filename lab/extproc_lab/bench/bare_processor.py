"""A do-nothing ext_proc server: the floor any Python (grpc.aio) processor pays through Envoy.

It answers every message at once with prebuilt responses (the body answer sends every request to
one fixed cluster), so ``extproc bench overhead`` can show how much of our processor's cost is
gRPC and Envoy's round trips and how much is routing. Not for production use.

    python -m extproc_lab.bench.bare_processor --listen 127.0.0.1:9002 --target replica-0

``--server`` picks the gRPC server under the same answers, to compare them for this message
pattern (``benchmarks/grpc_servers.py``): ``aio`` (grpcio's asyncio server, as our processor),
``uvloop`` (the same on uvloop's event loop), ``aio-rw`` and ``uvloop-rw`` (the same answered
through ``context.read()`` and ``context.write()`` instead of an async generator), ``sync``
(grpcio's thread-pool server, one thread a stream), ``grpclib`` (a pure-Python HTTP/2 server on
asyncio, as ``grpc.server: grpclib`` serves ours) and ``grpclib-uvloop``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc


def _responses(header: str, target: str) -> dict[str, pb.ProcessingResponse]:
    routed = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=header, raw_value=target.encode()))]
        ),
        clear_route_cache=True,
    )
    return {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed)),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }


class _Targets:
    """The prebuilt answers of each target (``target``: one or more, comma-separated); streams
    take the targets in turn, so a fleet's replicas share the load as they would behind a router."""

    def __init__(self, header: str, target: str) -> None:
        self.sets = [_responses(header, t) for t in target.split(",")]
        self.turn = itertools.count()

    def next(self) -> dict[str, pb.ProcessingResponse]:
        return self.sets[next(self.turn) % len(self.sets)]


class BareProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Answers each message with its prebuilt response."""

    def __init__(self, header: str, target: str) -> None:
        self.targets = _Targets(header, target)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """One answer per message."""
        answers = self.targets.next()
        async for request in request_iterator:
            yield answers[request.WhichOneof("request")]


class ReadWriteBareProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The same answers through grpc.aio's ``context.read()`` and ``context.write()``, not its
    request iterator and an async generator (one generator layer less each way)."""

    def __init__(self, header: str, target: str) -> None:
        self.targets = _Targets(header, target)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any) -> None:
        """One answer per message."""
        answers, read, write, eof = self.targets.next(), context.read, context.write, grpc.aio.EOF
        while (request := await read()) is not eof:
            await write(answers[request.WhichOneof("request")])


OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 32 << 20)]
SERVERS = ("aio", "uvloop", "aio-rw", "uvloop-rw", "sync", "grpclib", "grpclib-uvloop")


async def serve(listen: str, header: str, target: str, read_write: bool = False) -> None:
    """Serve with grpcio's asyncio server until cancelled."""
    server = grpc.aio.server(options=OPTIONS)
    servicer = ReadWriteBareProcessor(header, target) if read_write else BareProcessor(header, target)
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


class SyncBareProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The same answers from grpcio's thread-pool server: each stream holds a thread."""

    def __init__(self, header: str, target: str) -> None:
        self.targets = _Targets(header, target)

    def Process(
        self, request_iterator: Iterator[pb.ProcessingRequest], context: Any
    ) -> Iterator[pb.ProcessingResponse]:
        """One answer per message."""
        answers = self.targets.next()
        for request in request_iterator:
            yield answers[request.WhichOneof("request")]


def serve_sync(listen: str, header: str, target: str, threads: int) -> None:
    """Serve with grpcio's thread-pool server (``threads`` streams at once) until killed."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
    pb_grpc.add_ExternalProcessorServicer_to_server(SyncBareProcessor(header, target), server)
    server.add_insecure_port(listen)
    server.start()
    server.wait_for_termination()


async def serve_grpclib(listen: str, header: str, target: str) -> None:
    """Serve with grpclib (pure Python, no generated stubs: the one method mapped by hand)."""
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server, Stream

    targets = _Targets(header, target)

    async def process(stream: Stream[pb.ProcessingRequest, pb.ProcessingResponse]) -> None:
        answers = targets.next()
        async for request in stream:
            await stream.send_message(answers[request.WhichOneof("request")])

    class Mapped:
        def __mapping__(self) -> dict[str, Handler]:
            path = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
            return {path: Handler(process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse)}

    host, port = listen.rsplit(":", 1)
    server = Server([Mapped()])
    await server.start(host, int(port))
    await server.wait_closed()


def main() -> None:
    """Command line: ``--listen``, ``--header``, ``--target``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:9002")
    parser.add_argument("--header", default="x-target-cluster")
    parser.add_argument("--target", default="replica-0", help="one or more, comma-separated: streams take them in turn")
    parser.add_argument("--server", choices=SERVERS, default="aio")
    parser.add_argument("--threads", type=int, default=64, help="sync: the thread pool's size (streams at once)")
    args = parser.parse_args()
    if args.server == "sync":
        serve_sync(args.listen, args.header, args.target, args.threads)
    elif args.server == "grpclib":
        asyncio.run(serve_grpclib(args.listen, args.header, args.target))
    elif args.server == "grpclib-uvloop":
        import uvloop

        uvloop.run(serve_grpclib(args.listen, args.header, args.target))
    elif args.server in ("uvloop", "uvloop-rw"):
        import uvloop

        uvloop.run(serve(args.listen, args.header, args.target, read_write=args.server.endswith("-rw")))
    else:
        asyncio.run(serve(args.listen, args.header, args.target, read_write=args.server == "aio-rw"))


if __name__ == "__main__":
    main()
