"""What timing a streamed answer's tokens costs the processor per request (``docs/performance.md``).

A timed answer (``health.latency_models`` learning, or an objective possible) has its response
body streamed to the processor: every body piece Envoy reads from the replica is one more ext_proc
message and answer. This drives the processor's own stream (``RequestStream``, the planner, the
router) in process over streamed chat answers of ``--tokens`` events, one event a piece (as vLLM
writes them; Envoy may join some), messages parsed from and answers serialized to bytes as gRPC
would, and reports the processor's CPU time per request with the body timed and without.
Not counted: gRPC's transport and Envoy's side of each message (see ``extproc bench overhead``).

    .venv/bin/python benchmarks/token_timing_cost.py --requests 300 --tokens 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.api import Config, HealthSettings, Metrics, Planner, Replica, RequestStream, Router

CHAT = "/v1/chat/completions"


def _headers(headers: dict[str, str], end: bool = False, response: bool = False) -> bytes:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end)
    req = pb.ProcessingRequest(response_headers=msg) if response else pb.ProcessingRequest(request_headers=msg)
    return req.SerializeToString()


def _event(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def messages(i: int, tokens: int) -> list[bytes]:
    """One streamed chat request and its answer, as Envoy would send them (serialized)."""
    body = {"model": "m", "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": f"q {i}"}]}
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    pieces = [_event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    for t in range(tokens):
        pieces.append(
            _event({**head, "choices": [{"index": 0, "delta": {"content": f" w{t}"}, "finish_reason": None}]})
        )
    pieces.append(_event({**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}))
    pieces.append(b"data: [DONE]\n\n")
    out = [
        _headers({":path": CHAT, ":method": "POST", "x-session-id": f"s{i}"}),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
        ).SerializeToString(),
        _headers({":status": "200"}, response=True),
    ]
    for n, piece in enumerate(pieces):
        end = n == len(pieces) - 1
        out.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=end)).SerializeToString())
    return out


async def one(router: Router, wire: list[bytes]) -> int:
    """Play one request's ext_proc stream; the messages answered."""
    stream = RequestStream(Planner(router))
    answered = 0

    async def source():  # type: ignore[no-untyped-def]
        for data in wire:
            yield pb.ProcessingRequest.FromString(data)

    async for answer in stream.run(source()):
        answer.SerializeToString()
        answered += 1
    return answered


async def measure(timed: bool, requests: int, tokens: int) -> tuple[float, float]:
    replicas = [Replica(f"r{i}", f"127.0.0.1:{8100 + i}") for i in range(4)]
    mode = "always" if timed else "off"
    router = Router(
        Config(replicas=replicas, metrics=Metrics(enabled=False), health=HealthSettings(latency_models=mode))
    )
    # Untimed, Envoy sends no response body (the headers answer does not ask for it).
    wires = [messages(i, tokens)[: None if timed else 3] for i in range(requests)]
    for wire in wires[:20]:  # warm up
        await one(router, wire)
    started = time.process_time()
    answered = 0
    for wire in wires:
        answered += await one(router, wire)
    spent = time.process_time() - started
    return spent / requests, answered / requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for round_ in range(args.rounds):
        plain, plain_msgs = asyncio.run(measure(False, args.requests, args.tokens))
        timed, timed_msgs = asyncio.run(measure(True, args.requests, args.tokens))
        extra = timed - plain
        per_piece = extra / max(1.0, timed_msgs - plain_msgs)
        print(
            f"round {round_ + 1}: untimed {plain * 1e6:.0f} us/request ({plain_msgs:.0f} messages), "
            f"timed {timed * 1e6:.0f} us/request ({timed_msgs:.0f} messages): "
            f"+{extra * 1e6:.0f} us/request, {per_piece * 1e6:.1f} us per body piece"
        )


if __name__ == "__main__":
    main()
