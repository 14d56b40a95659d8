"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` gRPC service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.plan import Planner
from extproc.router import Router
from extproc.server import envoy_messages as msg
from extproc.server.stream import RequestStream

log = logging.getLogger("extproc.servicer")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One :class:`RequestStream` per Envoy ``Process`` stream."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.planner = Planner(router)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """Answer every message of one HTTP request's stream."""
        stream = RequestStream(self.planner, msg.trace_context(context.invocation_metadata()))
        try:
            async for response in stream.run(request_iterator):
                yield response
        except Exception as exc:
            # A bug must cost one request its routing, never the server: Envoy's failure_mode_allow
            # then sends it down the default route.
            self.router.metrics.stream_errors.labels("stream").inc()
            log.exception("ext_proc stream failed (%s)", type(exc).__name__)
            raise
