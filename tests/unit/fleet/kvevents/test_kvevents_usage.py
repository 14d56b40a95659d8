"""Reading a response body's reported cached tokens (bounded tail) and judging a prediction."""

from __future__ import annotations

import json

import pytest

from extproc.fleet.kvevents.usage import outcome
from extproc.request.usage import TAIL_BYTES, UsageTail


def usage(cached: int) -> dict[str, object]:
    return {"prompt_tokens": 500, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_the_last_report_is_found_whatever_the_chunking(piece: int) -> None:
    content = "x" * 20_000  # a long answer: the tail alone is kept
    body = json.dumps({"choices": [{"message": {"content": content}}], "usage": usage(480)}).encode()
    tail = UsageTail()
    for i in range(0, len(body), piece):
        tail.feed(body[i : i + piece])
    assert tail.cached_tokens() == 480
    assert len(tail._tail) <= TAIL_BYTES


def test_a_stream_reports_in_its_usage_chunk_and_none_without_it() -> None:
    chunks = [f"data: {json.dumps({'choices': [{'delta': {'content': 'a'}}]})}\n\n" for _ in range(50)]
    tail = UsageTail()
    for c in chunks:
        tail.feed(c.encode())
    assert tail.cached_tokens() is None  # no stream_options.include_usage: nothing to check
    tail.feed(f"data: {json.dumps({'choices': [], 'usage': usage(32)})}\n\ndata: [DONE]\n\n".encode())
    assert tail.cached_tokens() == 32


def test_outcomes_allow_one_block() -> None:
    assert outcome(480, 464, 16) == "agree"  # vLLM recomputes the last token of a cached prompt
    assert outcome(480, 0, 16) == "over"
    assert outcome(0, 64, 16) == "under"
