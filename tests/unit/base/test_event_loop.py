"""The processor's event loop: uvloop where installed, asyncio's on request or without it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from extproc.base import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_takes_uvloop_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")  # a dependency on this platform; absent only where it cannot install
    monkeypatch.delenv("EXTPROC_EVENT_LOOP", raising=False)
    assert event_loop.loop_choice() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_EVENT_LOOP", "asyncio")
    assert event_loop.loop_choice() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # the import fails, as where it is not installed
    monkeypatch.setenv("EXTPROC_EVENT_LOOP", "auto")
    assert event_loop.run(_loop_module()).startswith("asyncio")
    monkeypatch.setenv("EXTPROC_EVENT_LOOP", "uvloop")
    with pytest.raises(ImportError):
        event_loop.loop_choice()


def test_an_unknown_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="EXTPROC_EVENT_LOOP='trio'"):
        event_loop.loop_choice()
