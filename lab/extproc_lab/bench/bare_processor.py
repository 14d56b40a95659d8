"""A do-nothing ext_proc server: the floor any Python (grpc.aio) processor pays through Envoy.

It answers every message at once with prebuilt responses (the body answer sends every request to
one fixed cluster), so ``extproc bench overhead`` can show how much of our processor's cost is
gRPC and Envoy's round trips and how much is routing. Not for production use.

    python -m extproc_lab.bench.bare_processor --listen 127.0.0.1:9002 --target replica-0
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
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


class BareProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Answers each message with its prebuilt response."""

    def __init__(self, header: str, target: str) -> None:
        self.answers = _responses(header, target)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """One answer per message."""
        answers = self.answers
        async for request in request_iterator:
            yield answers[request.WhichOneof("request")]


async def serve(listen: str, header: str, target: str) -> None:
    """Serve until cancelled."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 32 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(BareProcessor(header, target), server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    """Command line: ``--listen``, ``--header``, ``--target``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:9002")
    parser.add_argument("--header", default="x-target-cluster")
    parser.add_argument("--target", default="replica-0")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.header, args.target))


if __name__ == "__main__":
    main()
