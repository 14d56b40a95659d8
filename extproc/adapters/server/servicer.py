"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` gRPC service."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.adapters.server import envoy_messages as msg
from extproc.adapters.server.envoy_check import EnvoyConfigCheck, body_announced
from extproc.adapters.server.stream import RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router

log = logging.getLogger("extproc.servicer")


class Reads:
    """A stream's messages through grpc.aio's ``context.read()``: the async iterator
    :meth:`RequestStream.run` takes, without the generator grpc.aio wraps around the same reads."""

    __slots__ = ("_read",)

    def __init__(self, context: Any) -> None:
        self._read = context.read

    def __aiter__(self) -> Reads:
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        request = await self._read()
        if request is grpc.aio.EOF:
            raise StopAsyncIteration
        return request


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One :class:`RequestStream` per Envoy ``Process`` stream."""

    def __init__(self, router: Router, check: EnvoyConfigCheck | None = None) -> None:
        self.router = router
        self.planner = Planner(router)
        self.check = check
        """Told what each stream shows of Envoy's ext_proc configuration (a body mode that cannot route)."""

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any) -> None:
        """Answer every message of one HTTP request's stream.

        Messages are read and answers written through ``context.read()`` and ``context.write()``
        (``request_iterator`` is not used): measured behind Envoy with the do-nothing processor,
        grpc.aio spends less CPU a request this way than driving an async generator handler and
        its request iterator (benchmarks/grpc_servers.py, ``aio-rw`` against ``aio``)."""
        await self.serve(Reads(context), context.write, context.invocation_metadata())

    async def serve(
        self,
        requests: AsyncIterator[pb.ProcessingRequest],
        write: Callable[[pb.ProcessingResponse], Awaitable[None]],
        metadata: Iterable[tuple[str, Any]] | None,
    ) -> None:
        """One stream, whichever gRPC server carries it: ``requests`` answered through ``write``;
        ``metadata``: the stream's gRPC metadata (Envoy's trace context)."""
        stream = RequestStream(self.planner, msg.trace_context(metadata))
        check, first = self.check, True
        try:
            # Closed on any exit: a write cancelled under it (Envoy reset the stream) still runs its
            # end, which releases the request's in-flight slot.
            async with contextlib.aclosing(stream.run(requests)) as answers:
                async for response in answers:
                    if first and check is not None:  # the first message's protocol_config is read by now
                        first = False
                        check.stream_began(stream.body_mode)
                    await write(response)
        except Exception as exc:
            # A bug must cost one request its routing, never the server: Envoy's failure_mode_allow
            # then sends it down the default route.
            self.router.metrics.stream_errors.labels("stream").inc()
            log.exception("ext_proc stream failed (%s)", type(exc).__name__)
            raise
        finally:
            if check is not None:
                # Headers that said a body follows, and no body and no plan at the end: none came.
                check.stream_ended(body_announced(stream.headers), stream.size > 0 or stream.plan is not None)
