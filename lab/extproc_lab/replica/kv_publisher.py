"""KV-cache events published as vLLM publishes them: a PUB socket sending
``[topic, seq (8 bytes big-endian), msgpack batch]``, and a ROUTER answering replays from a
buffer of the last ``buffer_steps`` batches.

As in vLLM, the PUB socket binds when the endpoint has ``*`` or ``::``, or is ``ipc://`` or
``inproc://``, and connects otherwise (to a router that binds one endpoint for all replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from extproc.api import Event, encode_batch
from extproc.api.sim import seq_frame

log = logging.getLogger("extproc_lab.replica.kv")


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds this endpoint (else it connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """One engine's event publisher. :meth:`publish` is synchronous (called from the engine's
    step); the replay ROUTER is served by a task started with :meth:`start`."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: str = "map",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        wall_clock: Callable[[], float] = time.time,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"kv events encoding {encoding!r}: map or array")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.encoding = encoding
        self.rank = data_parallel_rank
        self.wall_clock = wall_clock
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.drop_next = 0
        """Batches to buffer but not send (a lost message, for tests and the fault runs)."""
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        if binds(endpoint):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.router: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve replays (needs a running loop)."""
        if self.router is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replays(), name="kv-replay")

    def publish(self, events: Sequence[Event]) -> int:
        """Send one batch; returns its sequence number."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(self.wall_clock(), events, self.rank, self.encoding)
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return seq
        with contextlib.suppress(zmq.Again):
            # PUB never blocks; a full queue drops, as it does in vLLM (replay recovers it).
            self.pub.send_multipart([self.topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        return seq

    async def _serve_replays(self) -> None:
        assert self.router is not None
        while True:
            try:
                frames = await self.router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue
                identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        await self.router.send_multipart([identity, b"", self.topic, seq_frame(seq), payload])
                await self.router.send_multipart([identity, b"", b"", seq_frame(-1), b""])
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("kv replay: %s", exc)
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Stop serving and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        if self._own_ctx:
            self.ctx.destroy(0)
