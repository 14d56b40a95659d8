"""The ZMQ side of the KV events (pyzmq's asyncio sockets).

Two layouts, both supported:

- the router connects a SUB socket to each replica's publisher (``kv_events=tcp://...`` on the
  replica, or the pod's address and the configured port under discovery) and, for replays, a
  DEALER to its ROUTER (``kv_replay=``): every gateway reads every replica with no shared state;
- the router binds one SUB endpoint (``--kv-events-listen``) that replicas connect to, each
  message's topic ``kv@<replica>@<model>`` naming the replica by name or address.

A subscriber never stops the router: frames that do not parse are counted and dropped, and a
socket error restarts its loop after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from extproc.base.world import REAL_WORLD, Sleep, World
from extproc.fleet.kvevents.feed import KvEventSource
from extproc.fleet.kvevents.feed_state import ReplayError, topic_parts
from extproc.fleet.kvevents.wire import Message, WireError, seq_frame, split_message

log = logging.getLogger("extproc.fleet.kvevents")

RETRY_S = 1.0


class ZmqReplayer:
    """vLLM's replay protocol: a DEALER sends ``[b"", start]`` to the publisher's ROUTER, which
    answers each buffered batch with seq >= start as ``[b"", topic, seq, payload]`` and ends with
    ``[b"", b"", -1, b""]``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float = 1.0, max_messages: int = 20_000):
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_messages = max_messages

    async def __call__(self, start: int) -> Sequence[Message]:
        """The publisher's buffered messages from ``start``; :class:`ReplayError` if it fails."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart([b"", seq_frame(start)])
            out: list[Message] = []
            while len(out) <= self.max_messages:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), self.timeout_s)
                except TimeoutError:
                    raise ReplayError(f"no answer from {self.endpoint} within {self.timeout_s}s") from None
                if frames and frames[0] == b"":
                    frames = frames[1:]
                try:
                    msg = split_message(frames)
                except WireError as exc:
                    raise ReplayError(f"bad replay frame: {exc}") from None
                if msg.seq == -1 and not msg.topic:
                    return out
                out.append(msg)
            raise ReplayError(f"more than {self.max_messages} messages")
        except zmq.ZMQError as exc:
            raise ReplayError(str(exc)) from None
        finally:
            sock.close(0)


async def follow_replica(
    ctx: zmq.asyncio.Context,
    source: KvEventSource,
    replica: str,
    endpoint: str,
    replay_endpoint: str | None = None,
    model: str = "",
    replay_timeout_s: float = 1.0,
    rank: int = 0,
    sleep: Sleep = asyncio.sleep,
) -> None:
    """Read ``replica``'s publisher (its data-parallel ``rank``'s) until cancelled (connect layout);
    after a failure it tries again ``RETRY_S`` later, slept with ``sleep`` (the world's)."""
    replayer = ZmqReplayer(ctx, replay_endpoint, replay_timeout_s) if replay_endpoint else None
    source.add_feed(replica, replayer, model, rank)
    while True:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        watching: asyncio.Task[None] | None = None
        try:
            if replayer is not None:
                # The monitor is attached before connecting, so the first connection is the first
                # event it sees: attached later, it could miss it and take a reconnect for it.
                monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                watching = asyncio.create_task(_watch_reconnects(sock, monitor, source, replica, rank))
            sock.connect(endpoint)
            if replayer is not None:
                # Subscribed first, so what is published during the replay waits in the socket.
                await asyncio.sleep(0.05)  # real time: the subscription reaching the publisher
                await source.catch_up(replica, rank)
            while True:
                frames = await sock.recv_multipart()
                await _deliver(source, frames, replica)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a subscriber never stops the router
            log.warning("kv events from %s (%s): %s; again in %.0fs", replica, endpoint, exc, RETRY_S)
            await sleep(RETRY_S)
        finally:
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watching
            sock.close(0)


async def _watch_reconnects(
    sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, source: KvEventSource, replica: str, rank: int = 0
) -> None:
    """On every connection after the first, let the feed check what it missed (see
    :meth:`KvEventSource.reconnected`)."""
    connects = 0
    try:
        while True:
            frames = await monitor.recv_multipart()
            event = recv_monitor_message_from(frames)
            if event == zmq.EVENT_CONNECTED:
                connects += 1
                state = source.feeds.get(replica)
                try:
                    if state is not None and not state.synced and connects > 1:
                        await source.catch_up(replica, rank)  # the publisher was down when we started
                    elif connects > 1:
                        await source.reconnected(replica, rank)
                except Exception as exc:  # never stop the subscriber
                    log.warning("kv events: after reconnecting to %s: %s", replica, exc)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)


def recv_monitor_message_from(frames: Sequence[bytes]) -> int:
    """The event number of a monitor message (first frame: 16-bit event, 32-bit value)."""
    return int.from_bytes(frames[0][:2], "little") if frames and len(frames[0]) >= 2 else 0


async def listen(
    ctx: zmq.asyncio.Context,
    source: KvEventSource,
    endpoint: str,
    resolve: Callable[[str], str | None],
    sleep: Sleep = asyncio.sleep,
) -> None:
    """Bind one SUB endpoint that replicas connect to (``resolve`` maps a topic's replica part,
    a name or an address, to a member's name; None drops the message)."""
    while True:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(endpoint)
            while True:
                frames = await sock.recv_multipart()
                name = None
                if frames:
                    who, _ = topic_parts(bytes(frames[0]).decode("utf-8", "replace"))
                    name = resolve(who) if who else None
                if name is None:
                    source.metrics.messages_dropped("unknown")
                    continue
                await _deliver(source, frames, name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("kv events on %s: %s; again in %.0fs", endpoint, exc, RETRY_S)
            await sleep(RETRY_S)
        finally:
            sock.close(0)


async def _deliver(source: KvEventSource, frames: Sequence[bytes], replica: str) -> None:
    try:
        msg = split_message(frames)
    except WireError:
        source.metrics.messages_dropped(replica)
        return
    await source.receive(msg, replica)


class Subscriptions:
    """The running subscriber tasks, kept in step with the membership."""

    def __init__(self, source: KvEventSource, replay_timeout_s: float = 1.0, world: World = REAL_WORLD) -> None:
        self.source = source
        self.world = world  # reconnects wait on its time
        self.ctx = zmq.asyncio.Context()
        self.replay_timeout_s = replay_timeout_s
        self._tasks: dict[tuple[str, int], tuple[tuple[str, str | None], asyncio.Task[None]]] = {}
        self._listener: asyncio.Task[None] | None = None

    def follow(
        self, replica: str, endpoint: str, replay_endpoint: str | None = None, model: str = "", rank: int = 0
    ) -> None:
        """Read ``replica``'s publisher for data-parallel ``rank`` (restarted when its endpoints change)."""
        key = (endpoint, replay_endpoint)
        known = self._tasks.get((replica, rank))
        if known is not None and known[0] == key:
            return
        if known is not None:
            known[1].cancel()
        task = asyncio.create_task(
            follow_replica(
                self.ctx,
                self.source,
                replica,
                endpoint,
                replay_endpoint,
                model,
                self.replay_timeout_s,
                rank,
                self.world.sleep,
            ),
            name=f"kv-events-{replica}-dp{rank}",
        )
        self._tasks[(replica, rank)] = (key, task)

    def unfollow(self, replica: str, rank: int | None = None) -> None:
        """Stop reading ``replica`` (one ``rank``, else all, and then forget its entries)."""
        for who in [k for k in self._tasks if k[0] == replica and (rank is None or k[1] == rank)]:
            self._tasks.pop(who)[1].cancel()
        if rank is None:
            self.source.remove_feed(replica)
        else:
            self.source.remove_rank(replica, rank)

    def following(self) -> list[str]:
        """The replicas read in the connect layout."""
        return list(dict.fromkeys(k[0] for k in self._tasks))

    def ranks(self, replica: str) -> list[int]:
        """The data-parallel ranks of ``replica`` being read."""
        return sorted(k[1] for k in self._tasks if k[0] == replica)

    def listen(self, endpoint: str, resolve: Callable[[str], str | None]) -> None:
        """Bind ``endpoint`` for replicas that connect (listen layout)."""
        self._listener = asyncio.create_task(
            listen(self.ctx, self.source, endpoint, resolve, self.world.sleep), name="kv-events-listen"
        )

    async def close(self) -> None:
        """Cancel every task and close the context."""
        tasks = [t for _, t in self._tasks.values()]
        if self._listener is not None:
            tasks.append(self._listener)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.ctx.destroy(0)
