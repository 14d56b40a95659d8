"""The check of Envoy's ext_proc configuration: what each stream shows, how long a problem holds,
what is reported and logged."""

from __future__ import annotations

import logging

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from extproc.adapters.server.envoy_check import (
    NO_REQUEST_BODY,
    EnvoyConfigCheck,
    body_announced,
    problem_of_mode,
)

Mode = pm.ProcessingMode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[EnvoyConfigCheck, Clock, list[tuple[str, bool]]]:
    clock, reports = Clock(), []
    check = EnvoyConfigCheck(clock, lambda kind, present: reports.append((kind, present)), hold_s=60, repeat_s=30)
    return check, clock, reports


def test_modes_that_cannot_route() -> None:
    assert problem_of_mode(Mode.NONE) == NO_REQUEST_BODY
    # STREAMED routes too (Envoy 1.40 holds the request until the last chunk is answered).
    for fine in (Mode.BUFFERED, Mode.BUFFERED_PARTIAL, Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED):
        assert problem_of_mode(fine) is None


def test_body_announced_by_length_or_chunking() -> None:
    assert body_announced({"content-length": "120"})
    assert not body_announced({"content-length": "0"})
    assert body_announced({"transfer-encoding": "chunked"})
    assert not body_announced({":method": "GET"})


def test_an_announced_mode_none_is_a_problem_at_once_and_holds_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    check, clock, reports = make()
    assert check.evaluate() and reports == []
    with caplog.at_level(logging.ERROR, logger="extproc.envoy_check"):
        check.stream_began(Mode.NONE)
        assert not check.evaluate()
    assert reports == [(NO_REQUEST_BODY, True)]
    assert "no_request_body" in caplog.text and "request_body_mode: BUFFERED" in caplog.text
    # A good stream does not hide it (another Envoy may be broken): it holds for hold_s.
    check.stream_began(Mode.BUFFERED)
    clock.now += 59
    assert not check.evaluate() and check.problems() == [NO_REQUEST_BODY]
    clock.now += 2
    assert check.evaluate() and check.problems() == []
    assert reports == [(NO_REQUEST_BODY, True), (NO_REQUEST_BODY, False)]


def test_the_log_repeats_while_the_problem_lasts(caplog: pytest.LogCaptureFixture) -> None:
    check, clock, _ = make()
    with caplog.at_level(logging.ERROR, logger="extproc.envoy_check"):
        for _ in range(7):  # one stream a second for 7 s... then 30 s on
            check.stream_began(Mode.NONE)
            check.evaluate()
            clock.now += 1
        clock.now += 30
        check.stream_began(Mode.NONE)
        check.evaluate()
    logged = [r.getMessage().split(":")[0] for r in caplog.records]
    assert logged == ["ext_proc configuration problem no_request_body"] * 2


def test_without_an_announced_mode_three_bodyless_streams_in_a_row() -> None:
    check, _, reports = make()
    for _ in range(2):
        check.stream_ended(body_announced=True, body_seen=False)
    check.stream_ended(body_announced=True, body_seen=True)  # a body came: the count starts again
    for _ in range(2):
        check.stream_ended(body_announced=True, body_seen=False)
    check.stream_ended(body_announced=False, body_seen=False)  # a GET: no body expected, nothing learnt
    assert check.evaluate()
    check.stream_ended(body_announced=True, body_seen=False)
    assert not check.evaluate() and reports == [(NO_REQUEST_BODY, True)]
