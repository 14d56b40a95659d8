"""Real vLLM engines shared by the e2e modules that start them with the same flags.

Starting vLLM's CPU engines is most of those modules' time (tens of seconds each, on two cores):
:func:`tiny_engines` starts one fleet of the lab's ``tiny`` model for the session, on first use,
and hands it to each module fresh: every engine healthy (a module that killed one has it
restarted) and its prefix cache emptied (``POST /reset_prefix_cache``), so that no module finds
another's blocks. A module whose engines need other flags (another model, KV transfer) starts
its own.

The fleet's engines export their request spans to a receiver kept for the session
(``TinyEngines.receiver``): the tracing module reads them by its own trace id.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from extproc_lab.engines.fleet import EngineSettings, VllmFleet
from tests.conftest import require_engines
from tests.helpers import SpanReceiver, otlp_receiver

TINY_ENGINES = 3
"""As many as the module that needs the most (the hit ratio's three)."""
TINY_BLOCKS = 512
"""KV blocks of 32 tokens each engine (16,384 tokens): room for the hit-ratio module's sixteen
conversations over three engines, little enough that a module can fill one to evict."""


@dataclass
class TinyEngines:
    """The session's fleet of ``tiny`` engines and the receiver of their spans."""

    fleet: VllmFleet
    receiver: SpanReceiver

    def fresh(self) -> VllmFleet:
        """The fleet, every engine healthy and its prefix cache empty."""
        for replica in self.fleet.members:
            proc = self.fleet.group.procs.get(replica.name)
            if proc is None or proc.poll() is not None:
                self.fleet.restart(replica.name)
        self.fleet.wait()
        for replica in self.fleet.members:
            reset_prefix_cache(self.fleet.url(replica.name))
        return self.fleet


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> None:
    """Empty an engine's prefix cache (it refuses while a request holds blocks: retried)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the prefix cache was not reset within {timeout_s:.0f} s")
        time.sleep(0.5)  # real time: a real engine frees its blocks


@pytest.fixture(scope="session")
def tiny_engines() -> Iterator[TinyEngines]:
    """Three ``tiny`` engines for the session (KV events on, spans to the session's receiver)."""
    require_engines("tiny")
    with otlp_receiver() as receiver, tempfile.TemporaryDirectory(prefix="extproc-shared-vllm-") as logs:
        settings = EngineSettings(
            model="tiny",
            block_size=32,
            num_blocks=TINY_BLOCKS,
            max_model_len=2048,
            traces_endpoint=receiver.address,
        )
        with VllmFleet(replicas=TINY_ENGINES, settings=settings, log_dir=Path(logs)) as fleet:
            yield TinyEngines(fleet, receiver)
