"""The processor's event loop: uvloop's where it is installed (a dependency on Linux and macOS),
asyncio's own otherwise, or when ``EXTPROC_EVENT_LOOP=asyncio`` asks for it.

Measured behind the real Envoy (``benchmarks/grpc_servers.py``, ``benchmarks/overhead.md``): the
same grpc.aio server spends less CPU per ext_proc message on uvloop's loop, whose callbacks and
socket polling are native code, and nothing in the processor depends on which loop runs it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")
"""``EXTPROC_EVENT_LOOP``'s values: ``auto`` (the default) takes uvloop when it imports."""


def loop_choice() -> str:
    """Which loop :func:`run` takes: ``uvloop`` or ``asyncio``."""
    wanted = os.environ.get("EXTPROC_EVENT_LOOP", "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise ValueError(f"EXTPROC_EVENT_LOOP={wanted!r}: one of {', '.join(CHOICES)}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on the chosen loop (as :func:`asyncio.run`)."""
    if loop_choice() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
