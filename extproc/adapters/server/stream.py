"""One ext_proc stream (one HTTP request) as a state machine.

Each phase has one method, which takes the messages expected there (:data:`EXPECTED`)::

    REQUEST_HEADERS --request_headers, end_of_stream--> plan; the decision in the headers answer
                                                        --> RESPONSE_HEADERS (DONE if refused)
    REQUEST_HEADERS --request_headers--> REQUEST_BODY
        buffered: answered at once, with the response's watch (a mode override)
        FULL_DUPLEX_STREAMED (the Inference Extension's endpoint-picker protocol): held back
    REQUEST_BODY --request_body--> chunks gathered
        buffered: each chunk answered; at end_of_stream (or past max_body_bytes), plan; the
                  decision in the body answer --> RESPONSE_HEADERS (DONE if refused)
        FULL_DUPLEX_STREAMED: nothing answered; at end_of_stream (or request_trailers), plan;
                  the decision in the held-back headers answer, then the body streamed back
                  (then the trailers answer) --> RESPONSE_HEADERS (DONE if refused)
    RESPONSE_HEADERS --request_body, request_trailers--> let through (a body routed early)
    RESPONSE_HEADERS --response_headers--> a health sample (if watched);
                                           RESPONSE_BODY if the body is read, else DONE
    RESPONSE_BODY --response_body--> fed to the usage check, answered at once; DONE at its end
    RESPONSE_BODY, DONE --response_trailers--> let through
    stream end, in any phase: a body cut short is checked; the in-flight slot is released

Everything the plan holds (where to, which headers, which response to watch, the wording of a
refusal) comes from :class:`~extproc.app.plan.Planner`; this module only speaks Envoy.

The trace context Envoy sends in the stream's gRPC metadata (its own tracing on) takes the place
of the request's ``traceparent`` in the headers planned on: it is the span Envoy started for the
stream, a child of the request's span, which itself continues the client's context, so the
decision's span joins Envoy's trace whether or not the client sent one.

Every message gets an answer of its kind, whatever arrives and in whatever order: one not
expected in the phase is logged and let through unchanged; a failure while answering lets the
request through unrouted (Envoy's default route). Neither fails the stream.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.server import envoy_messages as msg
from extproc.adapters.server.subset_hint import with_subset_hint
from extproc.app.plan import EVERYTHING, Forward, Plan, Planner, Refuse, Watch
from extproc.observe.tracing import TRACEPARENT, TRACESTATE

log = logging.getLogger("extproc.stream")

Answers = list[pb.ProcessingResponse]


class Phase(enum.Enum):
    """Where a stream is: the next message it expects."""

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    RESPONSE_HEADERS = "response_headers"
    """The request is decided (or let through unrouted): the response is next."""
    RESPONSE_BODY = "response_body"
    """The response body is read for the cached tokens it reports."""
    DONE = "done"


EXPECTED: dict[Phase, frozenset[str]] = {
    Phase.REQUEST_HEADERS: frozenset({"request_headers"}),
    Phase.REQUEST_BODY: frozenset({"request_body", "request_trailers"}),
    Phase.RESPONSE_HEADERS: frozenset({"request_body", "request_trailers", "response_headers"}),
    Phase.RESPONSE_BODY: frozenset({"response_body", "response_trailers"}),
    Phase.DONE: frozenset({"response_trailers"}),
}
"""The messages each phase takes; any other is let through unchanged."""


class RequestStream:
    """Turns one stream's ProcessingRequests into ProcessingResponses, carrying out the planner's plan."""

    def __init__(self, planner: Planner, trace_context: Mapping[str, str] | None = None) -> None:
        self.planner = planner
        self.trace_context = dict(trace_context or {})
        """Envoy's span for this stream (``traceparent``, ``tracestate``), from the gRPC metadata."""
        self.phase = Phase.REQUEST_HEADERS
        self.body_mode: int = msg.BUFFERED  # Envoy says which in the first message's protocol_config
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.watch: Watch = EVERYTHING
        self.plan: Plan | None = None
        self._phases: dict[Phase, Callable[[pb.ProcessingRequest, str], Awaitable[Answers]]] = {
            Phase.REQUEST_HEADERS: self._request_headers,
            Phase.REQUEST_BODY: self._request_body,
            Phase.RESPONSE_HEADERS: self._response_headers,
            Phase.RESPONSE_BODY: self._response_body,
            Phase.DONE: self._done,
        }

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncGenerator[pb.ProcessingResponse, None]:
        """Answer each message of the stream; releases the request's in-flight slot at the end.

        While a timed stream waits for its first token, the next message is awaited only until
        its deadline (:meth:`~extproc.app.plan.Planner.first_token_deadline`): past it, the stream is
        ended with an immediate response, unasked (vLLM sends a stream's headers at once, so
        Envoy's first-byte timeout never sees a replica stuck before its first token)."""
        source = aiter(requests)
        waiting: asyncio.Future[pb.ProcessingRequest] | None = None
        try:
            while True:
                plan = self.plan if self.phase is Phase.RESPONSE_BODY else None  # a first token awaited
                deadline = self.planner.first_token_deadline(plan) if plan is not None else None
                try:
                    if deadline is None and waiting is None:
                        request = await anext(source)
                    else:
                        if waiting is None:
                            waiting = asyncio.ensure_future(anext(source))
                        left = None if deadline is None else max(0.0, deadline - self.planner.clock())
                        done, _ = await asyncio.wait((waiting,), timeout=left)
                        if not done:
                            for response in self._overdue():
                                yield response
                            continue
                        request, waiting = waiting.result(), None
                except StopAsyncIteration:
                    break
                for response in await self.answer(request):
                    yield response
        finally:
            if waiting is not None:
                waiting.cancel()
            if self.plan is not None:
                self.planner.end(self.plan)
            self.phase = Phase.DONE

    def _overdue(self) -> Answers:
        """The first token did not come in time: the stream is ended (Envoy resets the client's
        stream if its headers went out, else answers it with this error)."""
        assert self.plan is not None  # the deadline is set only with a plan
        self.phase = Phase.DONE
        return [msg.refuse(self.planner.first_token_overdue(self.plan))]

    @property
    def duplex(self) -> bool:
        """FULL_DUPLEX_STREAMED: the headers answer is held back until the body is complete."""
        return self.body_mode == msg.FULL_DUPLEX_STREAMED

    async def answer(self, request: pb.ProcessingRequest) -> Answers:
        """The answers to one message (none while full duplex holds them back); never raises."""
        if request.HasField("protocol_config"):
            self.body_mode = request.protocol_config.request_body_mode
        kind = request.WhichOneof("request") or ""
        phase = self.phase
        if kind not in EXPECTED[phase]:
            log.debug("%s not expected in phase %s: let through", kind or "empty message", phase.value)
            return [msg.passthrough(kind)]
        try:
            return await self._phases[phase](request, kind)
        except Exception:
            log.exception("answering %s in phase %s failed; letting it through", kind, phase.value)
            self.planner.stream_errors.labels("answer").inc()
            return self._failed(kind, phase)

    async def _request_headers(self, request: pb.ProcessingRequest, kind: str) -> Answers:
        headers = request.request_headers
        self.headers = with_subset_hint(msg.header_map(headers), request)
        if TRACEPARENT in self.trace_context:
            # The client's tracestate belongs to the client's traceparent, not to Envoy's.
            self.headers.pop(TRACESTATE, None)
            self.headers.update(self.trace_context)
        if headers.end_of_stream:
            return await self._decide(None)
        self.phase = Phase.REQUEST_BODY
        # Only this answer may change what Envoy sends next (and not with FULL_DUPLEX_STREAMED).
        self.watch = self.planner.watch(
            can_override=not self.duplex, whole_body=self.body_mode == msg.BUFFERED, headers=self.headers
        )
        if self.duplex:
            return []
        return [msg.headers_answer(self.planner.strip, self.watch.response_headers, self.body_mode)]

    async def _request_body(self, request: pb.ProcessingRequest, kind: str) -> Answers:
        if kind == "request_trailers":
            # Trailers end a full-duplex body; a buffered filter is configured not to send them.
            return await self._duplex_end(trailers=True) if self.duplex else [msg.passthrough(kind)]
        body = request.request_body
        self.chunks.append(body.body)
        self.size += len(body.body)
        if self.duplex:
            return await self._duplex_end(trailers=False) if body.end_of_stream else []
        if not body.end_of_stream and self.size <= self.planner.max_body_bytes:
            return [msg.continue_body()]
        data, self.chunks = b"".join(self.chunks), []
        return await self._decide(data)

    async def _duplex_end(self, trailers: bool) -> Answers:
        data = b"".join(self.chunks)
        parse = data if self.size <= self.planner.max_body_bytes else b""
        out = await self._decide(parse)
        self.chunks = []
        action = self.plan.action if self.plan is not None else None
        if not isinstance(action, Forward):  # refused: the client has its answer, nothing is streamed
            return out
        out.extend(msg.streamed_body(data if action.body is None else action.body))
        if trailers:
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return out

    async def _decide(self, body: bytes | None) -> Answers:
        """Plan the request; its decision answers the message that completed it: the request
        headers (no body, or full duplex) or, buffered, the body. Should planning fail, the
        request goes on unrouted."""
        self.phase = Phase.RESPONSE_HEADERS
        plan = await self.planner.plan(self.headers, body, self.watch)
        self.plan = plan
        if isinstance(plan.action, Refuse):
            self.phase = Phase.DONE
            return [msg.refuse(plan.action)]
        in_body = body is not None and not self.duplex
        return [msg.forward(plan.action, in_body)]

    async def _response_headers(self, request: pb.ProcessingRequest, kind: str) -> Answers:
        if kind != "response_headers":  # the rest of a body routed before its end
            return [msg.passthrough(kind)]
        self.phase = Phase.DONE
        if self.plan is None:  # let through unrouted after a failure: nothing to learn from
            return [msg.continue_response_headers()]
        read_body = self.planner.response_headers(self.plan, msg.header_map(request.response_headers))
        added = self.plan.response_set_headers
        if read_body:
            self.phase = Phase.RESPONSE_BODY
            return [msg.continue_response_headers(msg.streamed_response_body(self.body_mode), added)]
        return [msg.continue_response_headers(set_headers=added)]

    async def _response_body(self, request: pb.ProcessingRequest, kind: str) -> Answers:
        if kind == "response_body":
            assert self.plan is not None  # the phase is entered only with a plan
            body = request.response_body
            if body.end_of_stream:
                self.phase = Phase.DONE
            replaced = await self.planner.response_body(self.plan, body.body, body.end_of_stream)
            if replaced is not None:
                return [msg.replaced_response_body(replaced)]
        return [msg.passthrough(kind)]

    async def _done(self, request: pb.ProcessingRequest, kind: str) -> Answers:
        return [msg.passthrough(kind)]

    def _failed(self, kind: str, phase: Phase) -> Answers:
        """The answer after a failure in ``phase``: the message let through unchanged, and in full
        duplex, what was held back released with it (the request goes on unrouted)."""
        if phase is Phase.REQUEST_BODY and self.duplex:
            self.phase = Phase.RESPONSE_HEADERS
            data, self.chunks = b"".join(self.chunks), []
            out = [msg.continue_headers(self.planner.strip), *msg.streamed_body(data)]
            if kind == "request_trailers":
                out.append(msg.passthrough(kind))
            return out
        return [msg.passthrough(kind)]
