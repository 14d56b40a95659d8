"""One ext_proc stream (one HTTP request) as a small state machine.

    HEADERS --(end_of_stream)--------------------------> decide in the headers answer
    HEADERS --> BODY (accumulate until end_of_stream) --> decide in the body answer
    any     --> RESPONSE_HEADERS: observe status and time to first byte
    sampled --> RESPONSE_BODY (streamed, answered at once): the reported cached tokens checked
                against the KV-event index's prediction (kv_events.check_sample_rate)
    stream end: the request's in-flight slot is released

Every phase gets an answer, whatever arrives and in whatever order: a message out of order is
let through unchanged rather than failing the request.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.kvevents.usage import UsageTail
from extproc.router import Routed, Router
from extproc.routing.model import Reason
from extproc.server import envoy_messages as msg
from extproc.upstream_timeouts import ANSWERED_BY_HEADER, ATTEMPT_COUNT_HEADER, attempts

log = logging.getLogger("extproc.stream")


class Phase(enum.Enum):
    """Where a stream is."""

    HEADERS = "headers"
    BODY = "body"
    ROUTED = "routed"
    DONE = "done"


class RequestStream:
    """Turns one stream's ProcessingRequests into ProcessingResponses through the router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        cfg = router.config
        self.mode = cfg.mode
        self.remove = cfg.routing_headers
        self.phase = Phase.HEADERS
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.routed: Routed | None = None
        self.body_mode: int = msg.BUFFERED  # Envoy says which in the first message's protocol_config
        self.observe = True  # response headers feed health (false: asked for only to read the body)
        self.check_usage = False  # sampled: the response body is read for its reported cached tokens
        self.predicted: int | None = None  # cached tokens the KV-event index predicted
        self.usage: UsageTail | None = None

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """Answer each message of the stream; releases the request's in-flight slot at the end."""
        try:
            async for request in requests:
                if request.HasField("protocol_config"):
                    self.body_mode = request.protocol_config.request_body_mode
                try:
                    responses = await self.answer_duplex(request) if self.duplex else [await self.answer(request)]
                except Exception:
                    # Never fail the stream: an unrouted request still goes down Envoy's default route.
                    log.exception("answering %s failed; letting it through", request.WhichOneof("request"))
                    self.router.metrics.stream_errors.labels("answer").inc()
                    responses = (
                        self._duplex_fallback(request)
                        if self.duplex
                        else [msg.passthrough(request.WhichOneof("request") or "")]
                    )
                for response in responses:
                    yield response
        finally:
            if self.usage is not None:  # the body ended without end_of_stream (trailers, a reset)
                self._check_usage()
            if self.routed is not None:
                self.router.release(self.routed)
            self.phase = Phase.DONE

    @property
    def duplex(self) -> bool:
        """FULL_DUPLEX_STREAMED: answers are held back until the body is complete."""
        return self.body_mode == msg.FULL_DUPLEX_STREAMED

    async def answer(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """The response to one message."""
        kind = request.WhichOneof("request")
        if kind == "request_headers" and self.phase is Phase.HEADERS:
            self.headers = msg.header_map(request.request_headers)
            if request.request_headers.end_of_stream:
                return await self._decide(None, in_body=False)
            self.phase = Phase.BODY
            observe = self.router.sample_response()
            kv = self.router.kv_events
            # Mode overrides are ignored with a FULL_DUPLEX_STREAMED filter: checks need BUFFERED.
            self.check_usage = kv is not None and self.body_mode == msg.BUFFERED and kv.sample_check()
            if observe:
                return msg.continue_headers(self.remove)
            if self.check_usage:
                self.observe = False
                return msg.continue_headers(self.remove, msg.with_response_headers(self.body_mode))
            return msg.continue_headers(self.remove, msg.without_response_headers(self.body_mode))
        if kind == "request_body" and self.phase is Phase.BODY:
            body = request.request_body
            self.chunks.append(body.body)
            self.size += len(body.body)
            if not body.end_of_stream and self.size <= self.router.config.features.max_body_bytes:
                return msg.continue_body()
            data = b"".join(self.chunks)
            self.chunks = []
            return await self._decide(data, in_body=True)
        if kind == "response_headers":
            if self.routed is not None:
                response = msg.header_map(request.response_headers)
                status = response.get(":status", "0")
                tries = attempts(response.get(ATTEMPT_COUNT_HEADER))
                answered_by = response.get(ANSWERED_BY_HEADER)
                if self.observe:
                    code = int(status) if status.isdigit() else 0
                    self.router.observe_response(self.routed, code, tries, answered_by)
                chosen = self.routed.decision.replica
                own = tries == 1 or (chosen is not None and answered_by == chosen.address)
                # A body another replica answered (after a retry or a hedge): nothing to check.
                if self.predicted is not None and status == "200" and own:
                    self.usage = UsageTail()
                    return msg.continue_response_headers(msg.streamed_response_body(self.body_mode))
            return msg.continue_response_headers()
        if kind == "response_body" and self.usage is not None:
            self.usage.feed(request.response_body.body)
            if request.response_body.end_of_stream:
                self._check_usage()
            return msg.passthrough(kind)
        log.debug("message %s in phase %s let through", kind, self.phase.value)
        return msg.passthrough(kind or "")

    async def answer_duplex(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """FULL_DUPLEX_STREAMED (the mode the Gateway API Inference Extension's gateways use): the
        headers answer is held back until the body is complete, then sent with the decision,
        followed by the body itself, streamed back unchanged."""
        kind = request.WhichOneof("request")
        if kind == "request_headers" and self.phase is Phase.HEADERS:
            self.headers = msg.header_map(request.request_headers)
            if request.request_headers.end_of_stream:
                return [await self._decide(None, in_body=False)]
            self.phase = Phase.BODY
            return []
        if kind == "request_body" and self.phase is Phase.BODY:
            self.chunks.append(request.request_body.body)
            self.size += len(request.request_body.body)
            return await self._duplex_end(trailers=False) if request.request_body.end_of_stream else []
        if kind == "request_trailers" and self.phase is Phase.BODY:
            return await self._duplex_end(trailers=True)
        return [await self.answer(request)]

    async def _duplex_end(self, trailers: bool) -> list[pb.ProcessingResponse]:
        data = b"".join(self.chunks)
        self.chunks = []
        parse = data if self.size <= self.router.config.features.max_body_bytes else b""
        first = await self._decide(parse, in_body=False)
        if first.WhichOneof("response") == "immediate_response":
            return [first]
        if self.routed is not None and self.routed.body is not None:
            data = self.routed.body  # rewritten for its split arm; content-length set in `first`
        out = [first, *msg.streamed_body(data)]
        if trailers:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    def _check_usage(self) -> None:
        usage, self.usage = self.usage, None
        kv, routed = self.router.kv_events, self.routed
        if usage is None or kv is None or routed is None or self.predicted is None or routed.decision.replica is None:
            return
        kv.check(routed.decision.replica.name, self.predicted, usage.cached_tokens(), routed.features.tokens_per_block)

    def _duplex_fallback(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """After a failure in duplex mode: release what was held back, unrouted."""
        if self.phase is Phase.BODY and request.WhichOneof("request") in ("request_body", "request_trailers"):
            self.phase = Phase.ROUTED
            data, self.chunks = b"".join(self.chunks), []
            return [msg.continue_headers(self.remove), *msg.streamed_body(data)]
        return [msg.passthrough(request.WhichOneof("request") or "")]

    async def _decide(self, body: bytes | None, in_body: bool) -> pb.ProcessingResponse:
        self.phase = Phase.ROUTED
        routed = await self.router.route(self.headers, body)
        self.routed = routed
        decision = routed.decision
        kv = self.router.kv_events
        if self.check_usage and kv is not None and decision.replica is not None:
            self.predicted = kv.predicted_tokens(
                routed.features, decision.replica.name, decision.matched_blocks, routed.decided_at
            )
        if routed.refusal is not None:
            refusal = routed.refusal
            return msg.immediate(refusal.status, refusal.message, refusal.kind, retry_after_s=refusal.retry_after_s)
        if decision.reason is Reason.QUOTA:
            return msg.immediate(
                429,
                "this tenant is over its quota of concurrent requests; retry later",
                "quota_exceeded",
                retry_after_s=routed.decision.retry_after_s,
            )
        if decision.replica is None:
            # No replica known (discovery has not answered yet, or the fleet is empty): let Envoy
            # route it on its own (the default route); Envoy answers 503 itself if it has none.
            if routed.body is not None:
                return msg.rewritten(msg.continue_headers(self.remove), routed.body, in_body)
            return msg.continue_body() if in_body else msg.continue_headers(self.remove)
        cfg = self.router.config
        features = routed.features
        common, metadata = msg.routing_mutation(
            decision,
            self.mode,
            cfg.headers.target_cluster,
            cfg.headers.destination_endpoint,
            self.remove,
            cfg.upstream.request_headers(features.stream, features.max_output_tokens),
        )
        if in_body:
            response = msg.routed_body_response(common, metadata)
        else:
            response = msg.routed_headers_response(common, metadata)
        return response if routed.body is None else msg.rewritten(response, routed.body, in_body)
