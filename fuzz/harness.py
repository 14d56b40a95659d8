"""What the fuzzers drive: the request parser and the ext_proc stream handler, from raw bytes.

Shared by the atheris harnesses (``fuzz/fuzz_*.py``, coverage-guided, long runs) and the
hypothesis tests (``tests/project/test_fuzz.py``, bounded runs in the suite). The invariants: every
message gets exactly one answer of the matching kind, no exception escapes, and the router's
state stays within its bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.api import (
    MAX_DEMOTION,
    Config,
    FeatureSettings,
    Metrics,
    Planner,
    Prefix,
    Replica,
    RequestStream,
    Router,
    Sessions,
    answer_messages,
    extract_features,
)

SETTINGS = FeatureSettings(max_body_bytes=64 * 1024)
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/",
    "/v1/chat/completions?x=1",
    "/v1/messages",
    "/v1/responses",
)
ANSWER_KIND = {
    "request_headers": "request_headers",
    "request_body": "request_body",
    "request_trailers": "request_trailers",
    "response_headers": "response_headers",
    "response_body": "response_body",
    "response_trailers": "response_trailers",
}
MAX_SESSIONS = 200


def new_router() -> Router:
    """A router with small bounds, so a long fuzz run checks that they hold."""
    replicas = tuple(Replica(f"r{i}", f"127.0.0.{i + 1}:8000") for i in range(3))
    return Router(
        Config(
            replicas=replicas,
            metrics=Metrics(enabled=False),
            sessions=Sessions(max_sessions=MAX_SESSIONS),
            prefix=Prefix(blocks_per_replica=500),
        )
    )


def headers_from(data: bytes) -> dict[str, str]:
    """Headers made of arbitrary bytes: a path, a session header, a cookie, a tenant."""
    text = data.decode("utf-8", "surrogateescape")
    parts = text.split("\n", 4) + [""] * 4
    return {
        ":path": PATHS[len(parts[0]) % len(PATHS)] if len(parts[0]) % 3 else parts[0],
        "x-session-id": parts[1],
        "cookie": parts[2],
        "x-tenant-id": parts[3],
        "x-target-cluster": parts[4][:64],
        "x-vllm-priority": parts[1][:8],
    }


def check_features(data: bytes) -> None:
    """Feature extraction on arbitrary headers and body never raises."""
    split = len(data) // 3
    headers = headers_from(data[:split])
    features = extract_features(headers, data[split:], SETTINGS)
    assert features.path == headers[":path"].split("?", 1)[0]
    assert len(features.prefix_hashes) <= SETTINGS.max_blocks
    assert 0 <= features.hints.demotion <= MAX_DEMOTION
    answer_messages(data[split:])  # a Responses answer's body, as the router reads it: never raises


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "surrogateescape")) for k, v in headers.items()
        ]
    )


def messages_from(data: bytes) -> list[pb.ProcessingRequest]:
    """A sequence of ext_proc messages, in any order, with arbitrary headers and bodies."""
    out: list[pb.ProcessingRequest] = []
    i = 0
    while i < len(data) and len(out) < 12:
        op = data[i] % 8
        size = data[i + 1] * 16 if i + 1 < len(data) else 0
        chunk = data[i + 2 : i + 2 + size]
        i += 2 + size
        eos = bool(op & 1) if op < 6 else True
        if op in (0, 1):
            out.append(
                pb.ProcessingRequest(
                    request_headers=pb.HttpHeaders(headers=header_map(headers_from(chunk)), end_of_stream=eos)
                )
            )
        elif op in (2, 3):
            out.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos)))
        elif op == 4:
            status = {":status": str(chunk[:3].decode("latin-1"))}
            out.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(status))))
        elif op == 5:
            out.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        elif op == 6:
            out.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
        else:
            out.append(pb.ProcessingRequest())
    return out


async def run_stream(router: Router, messages: Sequence[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Drive one stream to its end."""

    async def source() -> AsyncIterator[pb.ProcessingRequest]:
        for m in messages:
            yield m

    return [r async for r in RequestStream(Planner(router)).run(source())]


def check_stream(router: Router, data: bytes) -> None:
    """One stream of fuzzed messages: one answer of the right kind per message, bounds hold."""
    messages = messages_from(data)
    answers = asyncio.run(run_stream(router, messages))
    assert len(answers) == len(messages)
    for message, answer in zip(messages, answers, strict=True):
        kind = message.WhichOneof("request")
        got = answer.WhichOneof("response")
        if kind is None:
            assert got == "request_headers"
        elif got != "immediate_response":
            assert got == ANSWER_KIND[kind], (kind, got)
    assert all(rec.inflight == 0 for rec in router.replicas.records())  # every slot released
    stats = router.store.stats()
    assert stats.sessions <= MAX_SESSIONS
    assert stats.prefix_blocks <= 500 * 3


def check_kv_events(data: bytes) -> None:
    """A KV-event message from arbitrary bytes: decoded or refused with WireError, and whatever
    decodes applies to an index without raising."""
    from extproc.api import ModelIndex, WireError, decode_batch, split_message

    parts = data.split(b"\x00\x00\x00", 2)
    try:
        msg = split_message(parts)
        batch = decode_batch(msg.payload)
    except WireError:
        try:
            batch = decode_batch(data)
        except WireError:
            return
    index = ModelIndex()
    index.apply("r", batch.events)
    assert index.blocks("r") >= 0
