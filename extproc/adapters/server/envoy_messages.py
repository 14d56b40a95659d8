"""Translation between ext_proc messages (upb-backed, from xds-protos) and plain values."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from extproc.app.plan import Forward, Refuse, ResponseHeaders
from extproc.observe.tracing import TRACE_CONTEXT

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
BUFFERED: int = pm.ProcessingMode.BUFFERED
FULL_DUPLEX_STREAMED: int = pm.ProcessingMode.FULL_DUPLEX_STREAMED
LB_NAMESPACE = "envoy.lb"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header list as a dict (Envoy sends values in ``raw_value``; older ones in ``value``)."""
    return {h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in headers.headers.headers}


def trace_context(metadata: Iterable[tuple[str, str]] | None) -> dict[str, str]:
    """The W3C trace context (``traceparent``, ``tracestate``) among an ext_proc stream's gRPC
    metadata: with its own tracing on, Envoy starts the stream as a child span of the request's
    and sends that span's context there (Envoy 1.40), not in the request headers."""
    return {key: value for key, value in metadata or () if key in TRACE_CONTEXT and isinstance(value, str)}


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=OVERWRITE
    )


def mutation(set_headers: Iterable[tuple[str, str]], remove: Iterable[str] = ()) -> pb.HeaderMutation:
    """A header mutation that sets (overwriting) and removes headers."""
    return pb.HeaderMutation(set_headers=[_set(k, v) for k, v in set_headers], remove_headers=list(remove))


def continue_headers(
    remove: Iterable[str] = (), mode_override: pm.ProcessingMode | None = None
) -> pb.ProcessingResponse:
    """Let request headers through, stripping the routing headers a client may have set.

    With ``mode_override`` (e.g. :func:`without_response_headers`), the answer also changes what
    Envoy sends next on this stream; Envoy applies it only when its filter has
    ``allow_mode_override``, as the rendered configs do, and only in this answer.
    """
    common = pb.CommonResponse(header_mutation=mutation((), remove)) if remove else pb.CommonResponse()
    response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
    if mode_override is not None:
        response.mode_override.CopyFrom(mode_override)
    return response


def _mode(request_body_mode: int, response_headers: int, response_body: int) -> pm.ProcessingMode:
    # Envoy replaces the whole mode with an override: everything else repeats the rendered config.
    return pm.ProcessingMode(
        request_header_mode=pm.ProcessingMode.SEND,
        response_header_mode=response_headers,
        request_body_mode=request_body_mode,
        response_body_mode=response_body,
        request_trailer_mode=pm.ProcessingMode.SKIP,
        response_trailer_mode=pm.ProcessingMode.SKIP,
    )


@functools.cache
def without_response_headers(request_body_mode: int) -> pm.ProcessingMode:
    """The processing mode that skips this request's response headers, its body mode unchanged
    (built once per body mode; the caller copies it into each answer)."""
    return _mode(request_body_mode, pm.ProcessingMode.SKIP, pm.ProcessingMode.NONE)


@functools.cache
def with_response_headers(request_body_mode: int) -> pm.ProcessingMode:
    """The processing mode that sends this request's response headers (whatever the config says),
    so that their answer may ask for the body (:func:`streamed_response_body`)."""
    return _mode(request_body_mode, pm.ProcessingMode.SEND, pm.ProcessingMode.NONE)


@functools.cache
def streamed_response_body(request_body_mode: int) -> pm.ProcessingMode:
    """The processing mode that sends this response's body in pieces as they arrive (STREAMED:
    each piece is answered at once and goes on unchanged; nothing is buffered)."""
    return _mode(request_body_mode, pm.ProcessingMode.SEND, pm.ProcessingMode.STREAMED)


_RESPONSE_HEADERS_THROUGH = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse()))


def continue_response_headers(
    mode_override: pm.ProcessingMode | None = None, set_headers: Sequence[tuple[str, str]] = ()
) -> pb.ProcessingResponse:
    """Let response headers through, with ``set_headers`` added (with ``mode_override``, change
    what follows). The plain answer is one shared message: it is only serialized, never changed."""
    if mode_override is None and not set_headers:
        return _RESPONSE_HEADERS_THROUGH
    common = pb.CommonResponse(header_mutation=mutation(set_headers)) if set_headers else pb.CommonResponse()
    response = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))
    if mode_override is not None:
        response.mode_override.CopyFrom(mode_override)
    return response


def forward(plan: Forward, in_body: bool) -> pb.ProcessingResponse:
    """A :class:`~extproc.app.plan.Forward` as the request-headers answer or (``in_body``, buffered
    mode) the body answer: one shared message for each plan without a body of its own (most
    requests of a fleet get one of a few: the replica's name, the same headers), only serialized,
    never changed; a plan with a replaced body is built each time.

    A replaced body's ``content-length`` is in the plan's headers, which apply in both modes: in
    buffered mode the headers wait with the body, and in full-duplex mode the headers answer was
    held back until the body was complete. The body itself replaces Envoy's buffer in a body
    answer; in full-duplex mode the caller streams it after the headers answer
    (:func:`streamed_body`).
    """
    if plan.body is None:
        return _shared_forward(plan, in_body)
    return _forward(plan, in_body)


@functools.lru_cache(maxsize=1024)
def _shared_forward(plan: Forward, in_body: bool) -> pb.ProcessingResponse:
    # Keyed by the whole plan (hashable, frozen): a traceparent's plan is one of its own, pushed out in turn.
    return _forward(plan, in_body)


def _forward(plan: Forward, in_body: bool) -> pb.ProcessingResponse:
    if in_body and plan.only_strips:
        return continue_body()
    common = pb.CommonResponse(clear_route_cache=plan.to_replica)
    if plan.set_headers or plan.remove_headers:
        common.header_mutation.CopyFrom(mutation(plan.set_headers, plan.remove_headers))
    metadata = None
    if plan.lb_metadata:
        metadata = struct_pb2.Struct()
        lb = metadata.get_or_create_struct(LB_NAMESPACE)
        for key, value in plan.lb_metadata:
            lb[key] = value
    if not in_body:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    if plan.body is not None:
        common.body_mutation.body = plan.body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def refuse(plan: Refuse) -> pb.ProcessingResponse:
    """A :class:`~extproc.app.plan.Refuse`: the client answered directly, with an OpenAI-style JSON error."""
    return immediate(plan.status, plan.message, plan.kind, retry_after_s=plan.retry_after_s, headers=plan.headers)


@functools.lru_cache(maxsize=64)
def headers_answer(remove: tuple[str, ...], choice: ResponseHeaders, request_body_mode: int) -> pb.ProcessingResponse:
    """:func:`continue_headers` with the mode override of ``choice``, built once for each (every
    request of a kind gets the same answer; it is only serialized, never changed)."""
    return continue_headers(remove, response_headers_mode(choice, request_body_mode))


def response_headers_mode(choice: ResponseHeaders, request_body_mode: int) -> pm.ProcessingMode | None:
    """The mode override a request-headers answer carries for a :class:`~extproc.app.plan.Watch`'s
    choice (None: the filter's own mode)."""
    if choice is ResponseHeaders.SEND:
        return with_response_headers(request_body_mode)
    if choice is ResponseHeaders.SKIP:
        return without_response_headers(request_body_mode)
    return None


STREAMED_CHUNK = 62 * 1024  # as the Inference Extension's picker: well under any message limit


def streamed_body(body: bytes) -> list[pb.ProcessingResponse]:
    """A whole body sent back in FULL_DUPLEX_STREAMED mode, in chunks, the last one ending it."""
    chunks = [body[i : i + STREAMED_CHUNK] for i in range(0, len(body), STREAMED_CHUNK)] or [b""]
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == len(chunks) - 1)
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


def continue_body() -> pb.ProcessingResponse:
    """Let a body chunk through (a partial body before the end of the stream)."""
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def immediate(
    status: int,
    message: str,
    kind: str,
    retry_after_s: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> pb.ProcessingResponse:
    """Answer the client directly with an OpenAI-style JSON error (``headers``: more to send)."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    sent = [("content-type", "application/json")]
    if retry_after_s is not None:
        sent.append(("retry-after", str(retry_after_s)))
    sent += [(k, v) for k, v in headers if k != "retry-after" or retry_after_s is None]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation(sent),
            body=body,
            details=kind,
        )
    )


def replaced_response_body(data: bytes) -> pb.ProcessingResponse:
    """A streamed response body's piece answered with ``data`` in its place."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=data)))
    )


def passthrough(kind: str) -> pb.ProcessingResponse:
    """An empty answer for a phase this server does not act on (trailers, response body)."""
    if kind == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if kind == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    if kind == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if kind == "response_headers":
        return continue_response_headers()
    if kind == "request_body":
        return continue_body()
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
