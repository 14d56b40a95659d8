"""Usage read from response bodies as they pass: JSON bodies, streams however chunked, and the
usage-only chunk taken out for clients that did not ask for it, every other byte unchanged."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.request.usage import Usage, UsageStripper, UsageTail, ask_for_usage

USAGE = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}


def _stream(with_usage: bool) -> bytes:
    chunks = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": f"tok{i} ü"}}], "usage": None} for i in range(7)
    ]
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
    if with_usage:
        events.append(b"data: " + json.dumps({"id": "c", "choices": [], "usage": USAGE}).encode() + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def test_a_json_body_reports_its_usage_from_the_tail() -> None:
    tail = UsageTail()
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "y" * 10_000}}], "usage": USAGE}).encode()
    for i in range(0, len(body), 1000):
        tail.feed(body[i : i + 1000])
    assert tail.usage() == Usage(input=120, cached_input=96, output=7)
    empty = UsageTail()
    empty.feed(b'{"usage": nonsense')
    assert empty.usage() is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5000), max_size=12))
def test_the_usage_chunk_is_taken_out_and_nothing_else_changes(points: list[int]) -> None:
    stripper = UsageStripper()
    pieces = _cuts(_stream(with_usage=True), points)
    out = b"".join(stripper.feed(p, end=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert out == _stream(with_usage=False)
    assert stripper.usage == Usage(input=120, cached_input=96, output=7)


def test_a_stream_is_asked_for_usage_once() -> None:
    asked = ask_for_usage({"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}})
    assert asked is not None and asked["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert ask_for_usage({"stream": True, "stream_options": {"include_usage": True}}) is None
    assert ask_for_usage({"model": "m"}) is None
