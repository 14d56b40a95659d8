"""Outage episodes: logged once each, flapping kept quiet, probes backing off."""

from __future__ import annotations

import logging

import pytest

from extproc.state.outage import Outage
from tests.helpers import Clock


def test_an_episode_is_logged_once_and_probes_back_off(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(0.0)
    outage = Outage("redis://h", base_delay_s=0.05, max_delay_s=0.3, clock=clock)
    caplog.set_level(logging.DEBUG, "extproc.state")
    assert outage.failed("lookup", ConnectionError("refused"))
    assert not any(outage.failed("record", ConnectionError("refused")) for _ in range(100))
    assert [outage.next_delay() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    clock.now = 2.0
    assert outage.recovered() and not outage.recovered()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "unavailable" in warnings[0] and "back after 2.0s (101 failed" in warnings[1]
    assert outage.next_delay() == 0.05  # the backoff starts over for the next episode


def test_a_flapping_store_is_reported_without_flooding_the_log(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(0.0)
    outage = Outage("redis://h", quiet_s=30, clock=clock)
    caplog.set_level(logging.WARNING, "extproc.state")
    for second in range(20):  # slow, not gone: a timeout, then a probe answers, again and again
        clock.now = float(second)
        outage.failed("lookup", TimeoutError("timed out"))
        outage.recovered()
    assert outage.episodes == 20 and len(caplog.records) == 2
    clock.now = 45.0
    outage.failed("lookup", TimeoutError("timed out"))
    assert len(caplog.records) == 3 and "19 brief outages" in caplog.records[-1].getMessage()
