"""The fault matrix: each fault injected into a real gateway on loopback (Envoy, the processor,
fake replicas, Redis) while conversations run through it, with what the clients saw.

Every case starts its own gateway, runs for a bounded time, stops every process it started by PID,
and returns :class:`CaseResult` rows: requests sent, requests lost (anything but a 200), and the
time to recover, whose meaning is given per case (``recover_what``). The tests
(``tests/e2e/test_fault_matrix.py``) run the cases at :data:`SMALL` scale and assert on the rows;
``benchmarks/fault_matrix.py`` runs them at :data:`LARGE` scale and writes the table.

A replica killed mid-replay is asserted in ``tests/e2e/test_failover_e2e.py`` (both modes, re-pinning,
readmission) and Redis killed under two processors in ``tests/e2e/test_shared_store_e2e.py``; here
:func:`replica_killed` measures the first under more concurrent load (the benchmark only), and
:func:`redis_outage` adds a hung Redis and the time to recover. The processes are started with
:class:`~extproc_lab.demo.gateway.LocalGateway`; a replica whose /metrics page breaks is
:mod:`extproc_lab.demo.faulty`; a replica that accepts connections and never answers is a normal one
stopped with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from extproc.api import Replica, UpstreamTimeouts
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import (
    Outcome,
    chat_body,
    closed_loop,
    in_rotation,
    lost,
    out_of_rotation,
    read_metrics,
    send,
    send_stream,
    stickiness,
    total,
)
from extproc_lab.demo.processes import free_port
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.demo.request_shapes import REQUEST_SHAPES, RequestShape
from extproc_lab.stats import percentile

TIME_SCALE = 0.02  # the demo replica at 50x speed: a turn takes milliseconds, not seconds
# Readmission after 1 s instead of 10 s, so a case sees a replica come back within its bound.
FAST_HEALTH = "health:\n  cooldown_s: 1.0\n"
Samples = dict[str, float]
GatewayT = TypeVar("GatewayT", bound=LocalGateway)


@dataclass(frozen=True, slots=True)
class Scale:
    """How big each case is; the tests use :data:`SMALL`, the benchmark :data:`LARGE`."""

    workers: int = 6  # concurrent conversations in the closed-loop cases
    warm_s: float = 1.0  # load before the fault
    fault_s: float = 1.5  # how long the fault lasts (at least)
    after_s: float = 1.0  # load after recovery
    route_timeout_s: int = 30  # Envoy's route timeout in the hung-replica case (the gateway's default: 300)
    first_byte_s: float = 0.5  # the hung-replica case's upstream.first_byte_s (default 8 s)
    stream_idle_s: float = 1.6  # and its upstream.stream_idle_s (> 3 tries x first_byte_s; default 25 s)
    unary_max_s: float = 1.0  # and its upstream.unary_max_s (default 60 s)
    unary_s_per_output_token: float = 0.01  # and this (default 0.3 s)
    shape_sessions: int = 24  # sessions warmed before the hang in the every-shape case
    shape_requests: int = 2  # requests of each shape sent after it
    hung_streams: int = 4  # streams flowing from the replica when it hangs
    sessions: int = 2000  # the many-sessions case
    session_bound: int = 1000  # its sessions.max_sessions
    revisits: int = 200  # sessions of that case sent a second turn
    burst: int = 200  # new sessions sent at once
    big_bodies: int = 3  # 8 MB requests
    big_body_bytes: int = 8_000_000
    streams: int = 8  # streaming requests in flight when their replica is killed


SMALL = Scale()
LARGE = Scale(
    workers=16,
    warm_s=3.0,
    fault_s=5.0,
    after_s=3.0,
    hung_streams=8,
    sessions=10_000,
    session_bound=100_000,
    revisits=1000,
    burst=800,
    big_bodies=8,
    streams=32,
    shape_requests=8,
)
# The shipped timeouts (upstream: defaults): what a hung replica costs each shape in production.
DEFAULTS = Scale(
    route_timeout_s=300,
    first_byte_s=UpstreamTimeouts().first_byte_s,
    stream_idle_s=UpstreamTimeouts().stream_idle_s,
    unary_max_s=UpstreamTimeouts().unary_max_s,
    unary_s_per_output_token=UpstreamTimeouts().unary_s_per_output_token,
    shape_requests=3,
)


@dataclass(slots=True)
class CaseResult:
    """One row of the matrix."""

    case: str
    requests: int
    lost: int
    recover_s: float | None
    recover_what: str
    notes: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


# --- the gateway and what watches it ------------------------------------------------------------


@dataclass
class FaultyGateway(LocalGateway):
    """A :class:`LocalGateway` whose replicas named in ``faulty`` run :mod:`extproc_lab.demo.faulty`
    (a normal fake replica whose /metrics page can be broken at run time)."""

    faulty: tuple[str, ...] = ()

    def start_replica(self, replica: Replica) -> None:
        """Start one replica, the faulty kind when named in :attr:`faulty`."""
        if replica.name not in self.faulty:
            super().start_replica(replica)
            return
        argv = [sys.executable, "-m", "extproc_lab.demo.faulty", "--name", replica.name, "--profile", self.profile]
        argv += ["--port", replica.address.rpartition(":")[2]]
        if self.time_scale is not None:
            argv += ["--time-scale", str(self.time_scale)]
        self.procs.start(replica.name, argv)
        self.procs.wait_healthy(replica.name, f"http://{replica.address}/health")

    def set_metrics_fault(self, name: str, mode: str) -> None:
        """Switch replica ``name``'s /metrics page to ``mode`` (ok, hang, garbage, nonsense)."""
        request = urllib.request.Request(f"{self.replica_url(name)}/_fault?metrics={mode}", method="POST")
        with urllib.request.urlopen(request, timeout=2) as resp:
            if resp.status != 200:
                raise RuntimeError(f"fault switch of {name} answered {resp.status}")


def with_config(gw: GatewayT, text: str) -> GatewayT:
    """Give ``gw``'s processor a config file holding ``text`` (before it starts)."""
    path = gw.dir / "router.yaml"
    path.write_text(text)
    gw.processor_args = (*gw.processor_args, "--config", str(path))
    return gw


class MetricWatch:
    """Polls a processor's /metrics in the background and keeps every sample with its time, so a
    case can tell afterwards when a replica left the rotation or the store came back."""

    def __init__(self, http: aiohttp.ClientSession, url: str, interval_s: float = 0.05) -> None:
        self.http = http
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, Samples]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                self.samples.append((time.monotonic(), await read_metrics(self.http, self.url)))
            await asyncio.sleep(self.interval_s)

    def first(self, predicate: Callable[[Samples], bool], after: float) -> float | None:
        """When ``predicate`` first held at or after ``after`` (monotonic time), else None."""
        return next((t for t, s in self.samples if t >= after and predicate(s)), None)

    async def until(self, predicate: Callable[[Samples], bool], after: float, timeout_s: float) -> float | None:
        """Wait up to ``timeout_s`` for :meth:`first`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.first(predicate, after)
            if found is not None:
                return found
            await asyncio.sleep(self.interval_s)
        return self.first(predicate, after)

    def latest(self) -> Samples:
        """The newest sample (empty before the first)."""
        return self.samples[-1][1] if self.samples else {}

    async def __aenter__(self) -> MetricWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@contextlib.asynccontextmanager
async def running_load(
    http: aiohttp.ClientSession, url: str, workers: int, tag: str, **options: Any
) -> AsyncIterator[list[Outcome]]:
    """Closed-loop conversations through ``url`` for the duration of the ``async with``."""
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    task = asyncio.create_task(closed_loop(http, url, stop, outcomes, workers=workers, tag=tag, **options))
    try:
        yield outcomes
    finally:
        stop.set()
        await task


def client() -> aiohttp.ClientSession:
    """A client without a connection limit (the burst opens hundreds at once)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def holder_of_most_sessions(outcomes: list[Outcome]) -> str:
    """The replica that answered the latest turn of the most sessions."""
    latest: dict[str, str] = {}
    for o in sorted(outcomes, key=lambda o: o.started):
        if o.ok:
            latest[o.session] = o.replica
    return Counter(latest.values()).most_common(1)[0][0]


def _between(outcomes: list[Outcome], start: float, end: float) -> list[Outcome]:
    return [o for o in outcomes if start <= o.started < end]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


# --- the cases ----------------------------------------------------------------------------------


async def processor_restart(scale: Scale = SMALL) -> CaseResult:
    """SIGKILL the processor under load, restart it after ``fault_s``.

    Envoy fails open (``failure_mode_allow``): requests take the default route, Envoy's round
    robin, so none is lost but sessions scatter; once the processor listens again, routing
    resumes. ``recover_s``: from the restart command to the first routed decision (process start
    included). The restarted processor's memory store is empty: sessions are pinned afresh.
    """
    with LocalGateway(replicas=3, time_scale=TIME_SCALE) as gw:
        async with (
            client() as http,
            MetricWatch(http, gw.metrics_url) as watch,
            running_load(http, gw.url, scale.workers, "proc") as outcomes,
        ):
            await asyncio.sleep(scale.warm_s)
            killed = time.monotonic()
            gw.procs.kill("processor")
            await asyncio.sleep(scale.fault_s)
            restarting = time.monotonic()
            await asyncio.to_thread(gw.start_processor)
            listening = time.monotonic()
            routed = await watch.until(lambda s: total(s, "extproc_decisions_total") > 0, listening, 10.0)
            await asyncio.sleep(scale.after_s)
    resumed = routed if routed is not None else float("inf")
    outage = _between(outcomes, killed, resumed)
    settled = resumed + 0.5  # turns started after the first routed decision had its pin
    after = stickiness(outcomes, since=settled)
    before = stickiness(outcomes, until=killed)
    return CaseResult(
        "processor killed (SIGKILL) and restarted under load",
        len(outcomes),
        len(lost(outcomes)),
        routed - restarting if routed is not None else None,
        "restart command to the first routed decision",
        f"{len(outage)} requests fell open to Envoy's round robin while it was down "
        f"({round(resumed - killed, 2)} s), sessions scattered meanwhile, sticky again after",
        {
            "lost_statuses": dict(Counter(o.status for o in lost(outcomes))),
            "fail_open_requests": len(outage),
            "fail_open_lost": len(lost(outage)),
            "process_start_s": round(listening - restarting, 2),
            "replica_changes_before": before.changes,
            "replica_changes_during": stickiness(outage).changes,
            "replica_changes_after": after.changes,
            "sessions_after": after.sessions,
        },
    )


async def redis_outage(scale: Scale = SMALL) -> list[CaseResult]:
    """Redis hung (SIGSTOP) then resumed, then killed (SIGKILL) and restarted empty, under load,
    with the processor on ``--store redis://``. The store pays its 50 ms timeout once, routes
    from its local mirror meanwhile (sessions stay put), and a probe finds Redis back.
    ``recover_s``: from Redis answering again to the processor's ``extproc_store_available`` 1."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}?namespace=faults"
    gw = LocalGateway(replicas=3, time_scale=TIME_SCALE, processor_args=("--store", url))
    redis = LocalRedis(gw.procs, gw.dir, port=port)
    available = lambda s: s.get("extproc_store_available{}") == 1.0  # noqa: E731
    unavailable = lambda s: s.get("extproc_store_available{}") == 0.0  # noqa: E731
    try:
        redis.start()
        gw.start()
        async with (
            client() as http,
            MetricWatch(http, gw.metrics_url) as watch,
            running_load(http, gw.url, scale.workers, "redis") as outcomes,
        ):
            await asyncio.sleep(scale.warm_s)
            paused = time.monotonic()
            redis.pause()
            noticed_hang = await watch.until(unavailable, paused, scale.fault_s)
            await asyncio.sleep(max(0.0, paused + scale.fault_s - time.monotonic()))
            redis.resume()
            resumed = time.monotonic()
            back_hang = await watch.until(available, resumed, 15.0)
            await asyncio.sleep(scale.after_s)
            killed = time.monotonic()
            redis.kill()
            noticed_kill = await watch.until(unavailable, killed, scale.fault_s)
            await asyncio.sleep(max(0.0, killed + scale.fault_s - time.monotonic()))
            await asyncio.to_thread(redis.start)
            restarted = time.monotonic()
            back_kill = await watch.until(available, restarted, 15.0)
            await asyncio.sleep(scale.after_s)
            with redis.client() as c:
                pins_after = sum(1 for _ in c.scan_iter(match="ext:{faults/*}:s:*", count=1000))
            store_errors = total(watch.latest(), "extproc_store_errors_total")
    finally:
        gw.stop()
    end = time.monotonic()
    rows = []
    for name, start, noticed, up, back, stop in (
        ("Redis hung (SIGSTOP) then resumed", paused, noticed_hang, resumed, back_hang, killed),
        ("Redis killed (SIGKILL) and restarted empty", killed, noticed_kill, restarted, back_kill, end),
    ):
        window = _between(outcomes, start, stop)
        slow = [o for o in window if o.ok]
        rows.append(
            CaseResult(
                name,
                len(window),
                len(lost(window)),
                back - up if back is not None else None,
                "Redis answering again to the store marked available",
                f"outage noticed after {_ms(noticed - start) if noticed else 'never'} ms; "
                f"p99 {_ms(percentile((o.latency_s for o in slow), 0.99))} ms during the episode; "
                f"{stickiness(window).changes} replica changes",
                {
                    "noticed_s": round(noticed - start, 3) if noticed is not None else None,
                    "p99_ms": _ms(percentile((o.latency_s for o in slow), 0.99)),
                    "replica_changes": stickiness(window).changes,
                },
            )
        )
    rows[1].facts["pins_in_redis_after"] = pins_after
    rows[1].facts["store_errors"] = store_errors
    return rows


async def replica_killed(scale: Scale = SMALL) -> CaseResult:
    """SIGKILL the replica holding most sessions under load, restart it after ``fault_s``.

    The assertions live in ``tests/e2e/test_failover_e2e.py``; this measures. Envoy retries connect
    failures and resets on another replica, and the processor ejects at once on connection
    refused. ``recover_s``: from the kill to the replica out of rotation."""
    with with_config(LocalGateway(replicas=3, time_scale=TIME_SCALE), FAST_HEALTH) as gw:
        async with (
            client() as http,
            MetricWatch(http, gw.metrics_url) as watch,
            running_load(http, gw.url, scale.workers, "kill") as outcomes,
        ):
            await asyncio.sleep(scale.warm_s)
            victim = holder_of_most_sessions(outcomes)
            killed = time.monotonic()
            gw.procs.kill(victim)
            ejected = await watch.until(out_of_rotation(victim), killed, 10.0)
            await asyncio.sleep(max(0.0, killed + scale.fault_s - time.monotonic()))
            restarting = time.monotonic()
            await asyncio.to_thread(gw.start_replica, next(r for r in gw.members if r.name == victim))
            readmitted = await watch.until(in_rotation(victim), restarting, 15.0)
            await asyncio.sleep(scale.after_s)
    after_eject = [o for o in outcomes if ejected is not None and ejected < o.started < restarting]
    return CaseResult(
        "replica killed (SIGKILL) under load, restarted",
        len(outcomes),
        len(lost(outcomes)),
        ejected - killed if ejected is not None else None,
        "kill to the replica out of rotation",
        f"readmitted {round(readmitted - restarting, 2) if readmitted else 'never'} s after restart "
        f"(1 s cooldown); {sum(o.replica == victim for o in after_eject)} requests reached it while out",
        {
            "victim": victim,
            "readmit_s": round(readmitted - restarting, 2) if readmitted is not None else None,
            "sessions_moved": len(stickiness(outcomes).moved_sessions),
            "lost_statuses": dict(Counter(o.status for o in lost(outcomes))),
            "lost_errors": sorted({o.error for o in lost(outcomes) if o.error}),
            "lost_started_after_kill_s": [round(o.started - killed, 3) for o in lost(outcomes)],
        },
    )


async def streams_on_a_killed_replica(scale: Scale = SMALL) -> CaseResult:
    """``streams`` streaming requests (300 tokens each, the demo replica in real time: about
    1.5 s) over two replicas; the replica serving most of them is killed half a second in.

    Streams already flowing from it cannot be retried (their first bytes reached the client):
    they must end at once with an error the client library reports, never hang. Streams on the
    other replica finish, and the next turn of every session succeeds elsewhere.
    ``recover_s``: from the kill to the replica out of rotation."""
    with LocalGateway(replicas=2, time_scale=1.0) as gw:
        async with client() as http, MetricWatch(http, gw.metrics_url) as watch:
            serving: dict[str, str] = {}
            bodies = [
                json.dumps(
                    {
                        "model": "demo-model",
                        "stream": True,
                        "max_tokens": 300,
                        "ignore_eos": True,  # the fake model would stop after 16 tokens otherwise
                        "messages": [{"role": "user", "content": f"stream {i}: tell me a long story " * 20}],
                    }
                ).encode()
                for i in range(scale.streams)
            ]
            tasks = [
                asyncio.create_task(send_stream(http, gw.url, f"stream-{i}", b, on_headers=serving.__setitem__))
                for i, b in enumerate(bodies)
            ]
            await asyncio.sleep(0.5)
            victim = Counter(serving.values()).most_common(1)[0][0]
            killed = time.monotonic()
            gw.procs.kill(victim)
            streams = await asyncio.gather(*tasks)
            ejected = await watch.until(out_of_rotation(victim), killed, 10.0)
            follow = await asyncio.gather(
                *(
                    send(http, gw.url, f"stream-{i}", 1, chat_body(f"stream {i}: and then?"))
                    for i in range(scale.streams)
                )
            )
    cut = [o for o in streams if o.replica == victim]
    others = [o for o in streams if o.replica != victim]
    ended_after = [round(o.ended - killed, 2) for o in cut]
    return CaseResult(
        "replica killed under streaming responses",
        len(streams) + len(follow),
        len(lost(streams)) + len(lost(follow)),
        ejected - killed if ejected is not None else None,
        "kill to the replica out of rotation",
        f"the {len(lost(streams))} lost were the streams flowing from it: each ended within "
        f"{max(ended_after, default=0):.2f} s of the kill with an error the client sees; "
        f"{sum(o.ok for o in others)}/{len(others)} streams on the other replica finished; "
        f"{sum(o.ok for o in follow)}/{len(follow)} next turns answered",
        {
            "victim": victim,
            "streams_on_victim": len(cut),
            "cut_errors": sorted({o.error.split(":")[0] for o in cut if o.error}),
            "cut_ended_after_kill_s": ended_after,
            "others_finished": sum(o.ok for o in others),
            "others": len(others),
            "next_turns_ok": sum(o.ok for o in follow),
        },
    )


async def replica_hung(scale: Scale = SMALL) -> CaseResult:
    """SIGSTOP the replica holding most sessions under load, with ``hung_streams`` streams
    flowing from it: it accepts connections (the kernel completes handshakes into its backlog)
    and never answers, then SIGCONT after the fault. The demo replica runs in real time here, so
    those streams (300 tokens, ~1.5 s) are still flowing when it stops.

    A request that had nothing back from it yet meets the first-byte timeout of its try
    (``upstream.first_byte_s``) and Envoy retries it on another replica: nothing is lost. A
    stream that already had its headers cannot be retried (the client has bytes); it ends with
    an error when Envoy's idle timeout (``upstream.stream_idle_s``) fires, instead of at the
    route timeout. The processor ejects the replica from those failed tries (Envoy's
    ``x-envoy-attempt-count``) and its scrapes timing out. ``recover_s``: from the hang to the
    replica out of rotation."""
    envoy = {
        "route_timeout_s": scale.route_timeout_s,
        "first_byte_timeout_s": scale.first_byte_s,
        "stream_idle_timeout_s": scale.stream_idle_s,
    }
    upstream = (
        f"upstream:\n  first_byte_s: {scale.first_byte_s}\n  stream_idle_s: {scale.stream_idle_s}\n"
        "  unary_s_per_output_token: 0.05\n"
    )
    gw = LocalGateway(replicas=3, time_scale=1.0, envoy_options=envoy)
    paused_pid = 0
    streams: list[Outcome] = []
    try:
        with_config(gw, FAST_HEALTH + upstream).start()
        async with (
            client() as http,
            MetricWatch(http, gw.metrics_url) as watch,
            running_load(http, gw.url, scale.workers, "hang", timeout_s=scale.route_timeout_s + 10.0) as outcomes,
        ):
            await asyncio.sleep(scale.warm_s)
            victim = holder_of_most_sessions(outcomes)
            pinned = sorted({o.session for o in outcomes if o.ok and o.replica == victim})
            flowing: asyncio.Queue[str] = asyncio.Queue()
            stream_tasks = [
                asyncio.create_task(
                    send_stream(
                        http,
                        gw.url,
                        session,
                        _long_stream_body(i),
                        timeout_s=scale.route_timeout_s + 10.0,
                        on_headers=lambda _s, replica: flowing.put_nowait(replica),
                    )
                )
                for i, session in enumerate((pinned * scale.hung_streams)[: scale.hung_streams])
            ]
            for _ in stream_tasks:  # each has its headers: flowing from the victim (its session is pinned there)
                await asyncio.wait_for(flowing.get(), 10.0)
            paused_pid = gw.procs.procs[victim].pid
            paused = time.monotonic()
            os.kill(paused_pid, signal.SIGSTOP)
            ejected = await watch.until(out_of_rotation(victim), paused, 10.0)
            # Hold the hang past every bound a request on it can meet: all its tries, or the idle
            # timeout of a stream, after the last request routed to it just before its ejection.
            bound = scale.first_byte_s * (1 + 2) + scale.stream_idle_s + 1.0
            hold_until = paused + max(scale.fault_s, bound)
            if ejected is not None:
                hold_until = max(hold_until, ejected + bound)
            await asyncio.sleep(max(0.0, hold_until - time.monotonic()))
            streams = list(await asyncio.gather(*stream_tasks))
            os.kill(paused_pid, signal.SIGCONT)
            paused_pid = 0
            resumed = time.monotonic()
            readmitted = await watch.until(in_rotation(victim), resumed, 15.0)
            await asyncio.sleep(scale.after_s)
    finally:
        if paused_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(paused_pid, signal.SIGCONT)
        gw.stop()
    unary_lost = lost(outcomes)
    # Non-streaming requests in flight when it hung or sent to it before its ejection: they met
    # the first-byte timeout and were answered by another replica (nothing else takes that long).
    retried = [o for o in outcomes if o.ok and o.latency_s >= 0.9 * scale.first_byte_s]
    cut = [o for o in streams if not o.ok]
    others = [o for o in outcomes if o.started >= paused and o.session not in pinned and o.ok]
    return CaseResult(
        "replica hung (SIGSTOP: accepts, never answers)",
        len(outcomes) + len(streams),
        len(unary_lost) + len(cut),
        ejected - paused if ejected is not None else None,
        "hang to the replica out of rotation",
        f"{len(unary_lost)} lost of the requests that had not started streaming: {len(retried)} met the "
        f"{scale.first_byte_s:g} s first-byte timeout and were retried on another replica (slowest "
        f"{_ms(max((o.latency_s for o in retried), default=0.0))} ms); the {len(cut)} lost were the "
        f"{len(streams)} streams flowing from it, each ended with an error "
        f"{max((o.ended - paused for o in cut), default=0.0):.2f} s after the hang at the latest "
        f"(idle timeout {scale.stream_idle_s:g} s, then Envoy's 1 s delayed close); "
        f"the route timeout ({scale.route_timeout_s} s) never met; "
        f"other sessions p99 {_ms(percentile((o.latency_s for o in others), 0.99))} ms",
        {
            "victim": victim,
            "unary_lost": len(unary_lost),
            "unary_statuses": dict(Counter(o.status for o in unary_lost)),
            "retried": len(retried),
            "retried_max_s": round(max((o.latency_s for o in retried), default=0.0), 3),
            "streams": len(streams),
            "streams_cut": len(cut),
            "streams_cut_after_s": sorted(round(o.ended - paused, 2) for o in cut),
            "others_p99_ms": _ms(percentile((o.latency_s for o in others), 0.99)),
            "readmit_s": round(readmitted - resumed, 2) if readmitted is not None else None,
            "first_byte_s": scale.first_byte_s,
            "stream_idle_s": scale.stream_idle_s,
            "route_timeout_s": scale.route_timeout_s,
        },
    )


def shape_timeouts(scale: Scale) -> UpstreamTimeouts:
    """The ``upstream:`` section of :func:`replica_hung_every_shape` at ``scale``."""
    return UpstreamTimeouts(
        first_byte_s=scale.first_byte_s,
        stream_idle_s=scale.stream_idle_s,
        unary_s_per_output_token=scale.unary_s_per_output_token,
        unary_max_s=scale.unary_max_s,
    )


async def replica_hung_every_shape(
    scale: Scale = SMALL, mode: str = "cluster", health_check_path: str | None = "/health", profile: str = ""
) -> CaseResult:
    """``shape_sessions`` sessions pinned over three replicas (by default the rendered failover
    scenario: cluster mode with Envoy's health checks), then the replica holding most of them
    stops (SIGSTOP: it accepts connections, never answers) and ``shape_requests`` requests of
    every :data:`~extproc_lab.demo.request_shapes.REQUEST_SHAPES` follow on its sessions, at
    once, before the processor has noticed: chat and completions, streamed and not, without
    ``max_tokens``, with a small one and with one beyond any context.

    Each must be answered 200 by another replica once its try's budget passed
    (:meth:`RequestShape.budget_s`: a stream's first-byte timeout, a non-streaming request's
    ``min(first_byte_s + max_tokens x unary_s_per_output_token, unary_max_s)``), plus the retry's
    own time. ``recover_s``: the slowest answer after the hang. ``profile``: config text naming a
    routing profile (the price sends a session away from a replica whose requests go unanswered
    once their queue costs more than its short history: not every request tries it)."""
    upstream = shape_timeouts(scale)
    envoy: dict[str, Any] = {
        "route_timeout_s": scale.route_timeout_s,
        "first_byte_timeout_s": upstream.first_byte_s,
        "stream_idle_timeout_s": upstream.stream_idle_s,
        "health_check_path": health_check_path,
    }
    config = (
        f"upstream:\n  first_byte_s: {upstream.first_byte_s}\n  stream_idle_s: {upstream.stream_idle_s}\n"
        f"  unary_s_per_output_token: {upstream.unary_s_per_output_token}\n  unary_max_s: {upstream.unary_max_s}\n"
    )
    gw = with_config(
        LocalGateway(replicas=3, mode=mode, time_scale=1.0, envoy_options=envoy), FAST_HEALTH + config + profile
    )
    paused_pid = 0
    sent: list[tuple[RequestShape, Outcome]] = []
    try:
        gw.start()
        async with client() as http:
            warm = await asyncio.gather(
                *(
                    send(http, gw.url, f"shape-{i}", 0, chat_body(f"shape {i}: hello"))
                    for i in range(scale.shape_sessions)
                )
            )
            if lost(list(warm)):
                raise RuntimeError(f"the warm-up lost requests: {lost(list(warm))}")
            victim = Counter(o.replica for o in warm).most_common(1)[0][0]
            pinned = [o.session for o in warm if o.replica == victim]
            paused_pid = gw.procs.procs[victim].pid
            os.kill(paused_pid, signal.SIGSTOP)
            paused = time.monotonic()
            shapes = [shape for shape in REQUEST_SHAPES for _ in range(scale.shape_requests)]
            sessions = [pinned[i % len(pinned)] for i in range(len(shapes))]
            timeout_s = scale.route_timeout_s + 10.0
            outcomes = await asyncio.gather(
                *(
                    send_stream(http, gw.url, session, shape.body(f"{session} again"), timeout_s, path=shape.path)
                    if shape.stream
                    else send(http, gw.url, session, 1, shape.body(f"{session} again"), timeout_s, path=shape.path)
                    for shape, session in zip(shapes, sessions, strict=True)
                )
            )
            sent = list(zip(shapes, outcomes, strict=True))
            os.kill(paused_pid, signal.SIGCONT)
            paused_pid = 0
    finally:
        if paused_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(paused_pid, signal.SIGCONT)
        gw.stop()
    per_shape: dict[str, dict[str, Any]] = {}
    for shape in REQUEST_SHAPES:
        got = [o for s, o in sent if s == shape]
        per_shape[shape.name] = {
            "budget_s": shape.budget_s(upstream),
            "lost": len(lost(got)),
            "from_victim": sum(o.replica == victim for o in got),
            "latency_s": sorted(round(o.latency_s, 2) for o in got),
        }
    every = [o for _, o in sent]
    slowest = max((o.ended - paused for o in every), default=0.0)
    over = {
        name: f["latency_s"][-1]
        for name, f in per_shape.items()
        if f["latency_s"] and f["latency_s"][-1] > f["budget_s"] + 1.0
    }
    hc = f"Envoy health checks on {health_check_path}" if health_check_path else "no Envoy health checks"
    return CaseResult(
        f"replica hung, every request shape ({mode} mode, {hc})",
        len(every),
        len(lost(every)),
        slowest,
        "hang to the slowest answer",
        f"{len(every)} requests of {len(REQUEST_SHAPES)} shapes on the hung replica's sessions, "
        f"{sum(f['from_victim'] for f in per_shape.values())} answered by it; each shape's slowest vs its "
        "budget: "
        + "; ".join(f"{name} {f['latency_s'][-1]:g} s / {f['budget_s']:g} s" for name, f in per_shape.items())
        + (f"; over budget + 1 s: {over}" if over else ""),
        {
            "victim": victim,
            "pinned_sessions": len(pinned),
            "mode": mode,
            "health_check_path": health_check_path,
            "first_byte_s": upstream.first_byte_s,
            "unary_max_s": upstream.unary_max_s,
            "unary_s_per_output_token": upstream.unary_s_per_output_token,
            "route_timeout_s": scale.route_timeout_s,
            "per_shape": per_shape,
            "lost_statuses": dict(Counter(o.status for o in lost(every))),
        },
    )


def _long_stream_body(index: int) -> bytes:
    return json.dumps(
        {
            "model": "demo-model",
            "stream": True,
            "max_tokens": 300,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"hung {index}: tell me a long story"}],
        }
    ).encode()


async def metrics_faults(
    scale: Scale = SMALL, modes: tuple[str, ...] = ("negative", "hang", "garbage", "absurd")
) -> list[CaseResult]:
    """One replica's /metrics page hangs, returns garbage, or returns absurd values, in turn, while
    the replica itself keeps answering requests. Routing must go on without a client error; the
    replica is ejected (its scrapes fail) or its absurd load keeps it out of the way.
    ``recover_s``: from the fault to the replica out of rotation (None: never ejected)."""
    victim = "replica-0"
    gw = with_config(FaultyGateway(replicas=3, time_scale=TIME_SCALE, faulty=(victim,)), FAST_HEALTH)
    rows = []
    with gw:
        async with (
            client() as http,
            MetricWatch(http, gw.metrics_url) as watch,
            running_load(http, gw.url, scale.workers, "metrics") as outcomes,
        ):
            await asyncio.sleep(scale.warm_s)
            for mode in modes:
                start = time.monotonic()
                await asyncio.to_thread(gw.set_metrics_fault, victim, mode)
                ejected = await watch.until(out_of_rotation(victim), start, scale.fault_s)
                await asyncio.sleep(max(0.0, start + scale.fault_s - time.monotonic()))
                ended = time.monotonic()
                await asyncio.to_thread(gw.set_metrics_fault, victim, "ok")
                readmitted = await watch.until(in_rotation(victim), ended, 15.0)
                window = _between(outcomes, start, readmitted or time.monotonic())
                # Sessions that started once the broken page had been scraped a couple of times:
                # a fair share is 1/3; a router that believed a page saying "emptier than idle"
                # would send nearly all of them there.
                fresh = [o for o in _between(outcomes, start + 0.6, ended) if o.turn == 0 and o.ok]
                share = sum(o.replica == victim for o in fresh) / len(fresh) if fresh else 0.0
                served_out = sum(o.replica == victim for o in window if ejected and ejected + 0.2 < o.started < ended)
                rows.append(
                    CaseResult(
                        f"/metrics {mode}",
                        len(window),
                        len(lost(window)),
                        ejected - start if ejected is not None else None,
                        "fault to the replica out of rotation",
                        f"{'ejected' if ejected else 'not ejected'}; it took {share:.0%} of the "
                        f"{len(fresh)} sessions that started during the fault (fair: 33%); "
                        f"back in rotation {round(readmitted - ended, 2) if readmitted else 'never'} s after "
                        "its page healed",
                        {
                            "ejected": ejected is not None,
                            "new_session_share": round(share, 2),
                            "new_sessions": len(fresh),
                            "served_while_out": served_out,
                            "readmit_s": round(readmitted - ended, 2) if readmitted is not None else None,
                            "scrape_errors_total": total(watch.latest(), "extproc_replica_scrape_errors_total"),
                        },
                    )
                )
    return rows


async def big_bodies(scale: Scale = SMALL) -> CaseResult:
    """Requests of about 8 MB (under the processor's 8 MiB parse limit and Envoy's 16 MiB buffer),
    several turns of one session, with small conversations running beside them, against replicas
    that answer at once (profile ``instant``), so the time is Envoy's and the processor's.

    Each must be answered 200 and decided by the processor (every request sent through it is
    counted in its decisions: none fell open on Envoy's 1 s message timeout), every turn on one
    replica. The same body through Envoy's plain round robin gives the baseline."""
    with LocalGateway(replicas=3, profile="instant") as gw:
        async with client() as http:
            before = await read_metrics(http, gw.metrics_url)
            big: list[Outcome] = []
            baseline: list[Outcome] = []
            async with running_load(http, gw.url, 4, "small") as small:
                await asyncio.sleep(0.5)
                text = "x" * (scale.big_body_bytes - 200)
                for turn in range(scale.big_bodies):
                    body = chat_body(text + f" turn {turn}")
                    big.append(await send(http, gw.url, "big-session", turn, body, timeout_s=60))
                    baseline.append(await send(http, gw.round_robin_url, "big-baseline", turn, body, timeout_s=60))
                small_during = [o for o in small if o.started >= big[0].started]
            after = await read_metrics(http, gw.metrics_url)
            rss = processor_rss(gw)
    replicas = {o.replica for o in big if o.ok}
    body_errors = total(after, "extproc_request_body_errors_total") - total(before, "extproc_request_body_errors_total")
    decided = total(after, "extproc_decisions_total") - total(before, "extproc_decisions_total")
    ours, plain = percentile((o.latency_s for o in big), 0.5), percentile((o.latency_s for o in baseline), 0.5)
    return CaseResult(
        f"{scale.big_bodies} bodies of {scale.big_body_bytes / 1e6:g} MB beside small requests",
        len(big) + len(baseline) + len(small),
        len(lost(big)) + len(lost(baseline)) + len(lost(small)),
        None,
        "",
        f"8 MB p50 {_ms(ours)} ms through the processor, {_ms(plain)} ms through Envoy alone; "
        f"all {len(big)} turns decided by the processor, on one replica: {len(replicas) == 1}; "
        f"small requests beside them p99 {_ms(percentile((o.latency_s for o in small_during), 0.99))} ms",
        {
            "big_latency_ms": [_ms(o.latency_s) for o in big],
            "baseline_latency_ms": [_ms(o.latency_s) for o in baseline],
            "added_p50_ms": _ms(ours - plain),
            "big_replicas": sorted(replicas),
            "body_errors": body_errors,
            "decided": decided,
            "sent_through_processor": len(big) + len(small),
            "processor_rss_mib": round(rss / 2**20, 1) if rss else None,
            "small_p99_ms": _ms(percentile((o.latency_s for o in small_during), 0.99)),
        },
    )


async def many_sessions(scale: Scale = SMALL, concurrency: int = 64) -> CaseResult:
    """``sessions`` distinct sessions in a short window (``concurrency`` requests at a time), with
    ``sessions.max_sessions`` at ``session_bound``; then a second turn for ``revisits`` of them.

    No request may fail, the session map must stay within its bound, and the revisited sessions
    (the most recent ones, which the LRU bound keeps) must land where their first turn did."""
    config = f"sessions:\n  max_sessions: {scale.session_bound}\n"
    with with_config(LocalGateway(replicas=4, time_scale=TIME_SCALE), config) as gw:
        async with client() as http:
            gate = asyncio.Semaphore(concurrency)
            first: list[Outcome] = []
            peak = 0

            async def one(i: int, turn: int, out: list[Outcome]) -> None:
                async with gate:
                    body = chat_body(f"session {i} asks about topic {i * 7919 % 10007} " * 8 + f"turn {turn}")
                    out.append(await send(http, gw.url, f"many-{i}", turn, body))

            async def watch_sessions(stop: asyncio.Event) -> None:
                nonlocal peak
                while not stop.is_set():
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        peak = max(peak, int((await read_metrics(http, gw.metrics_url))["extproc_sessions{}"]))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.5)

            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_sessions(stop))
            started = time.monotonic()
            await asyncio.gather(*(one(i, 0, first) for i in range(scale.sessions)))
            elapsed = time.monotonic() - started
            revisit_ids = range(scale.sessions - scale.revisits, scale.sessions)
            second: list[Outcome] = []
            await asyncio.gather(*(one(i, 1, second) for i in revisit_ids))
            stop.set()
            await watcher
            samples = await read_metrics(http, gw.metrics_url)
            rss = processor_rss(gw)
    where = {o.session: o.replica for o in first if o.ok}
    moved = [o for o in second if o.ok and where.get(o.session) != o.replica]
    held = int(samples["extproc_sessions{}"])
    return CaseResult(
        f"{scale.sessions:,} distinct sessions, {concurrency} at a time",
        len(first) + len(second),
        len(lost(first)) + len(lost(second)),
        None,
        "",
        f"{scale.sessions / elapsed:.0f} new sessions/s; session map {held:,} (bound {scale.session_bound:,}, "
        f"peak {max(peak, held):,}); {len(second) - len(moved)}/{len(second)} revisits on their replica; "
        f"p99 {_ms(percentile((o.latency_s for o in first), 0.99))} ms",
        {
            "sessions_held": held,
            "sessions_peak": max(peak, held),
            "session_bound": scale.session_bound,
            "prefix_blocks": int(samples["extproc_prefix_index_blocks{}"]),
            "revisits_moved": len(moved),
            "new_sessions_per_s": round(scale.sessions / elapsed),
            "processor_rss_mib": round(rss / 2**20, 1) if rss else None,
        },
    )


async def session_burst(scale: Scale = SMALL, replicas: int = 4, shared_system_prompt: bool = False) -> CaseResult:
    """``burst`` new sessions sent at the same instant. In-flight work is counted at decision
    time, so they should spread: no replica above 1.5x its share.

    With ``shared_system_prompt`` every prompt opens with the same 2 KB system prompt and a short
    question after it (a chat application's first turns): the first decision indexes that prefix
    on one replica, and every later one then sees a replica holding 90% of its prompt. Whether
    load outweighs that pull is what this variant shows."""
    system = "You are a careful assistant for the harbor authority. " * 40
    # The replicas run in real time: at the matrix's 50x speed a request was over before the
    # later ones of the burst were decided, so they met idle replicas (and, with the shared
    # prompt, one holding it): not a burst, and the busiest share varied from 1.0x to 1.5x.
    with LocalGateway(replicas=replicas, time_scale=1.0) as gw:
        async with client() as http:
            bodies = []
            for i in range(scale.burst):
                messages = [{"role": "user", "content": f"burst question {i}: " + "which berth is free " * 5}]
                if shared_system_prompt:
                    messages.insert(0, {"role": "system", "content": system})
                bodies.append(json.dumps({"model": "demo-model", "max_tokens": 2, "messages": messages}).encode())
            outcomes = await asyncio.gather(*(send(http, gw.url, f"burst-{i}", 0, b) for i, b in enumerate(bodies)))
    counts = Counter(o.replica for o in outcomes if o.ok)
    share = scale.burst / replicas
    worst = max(counts.values(), default=0) / share
    prompts = "sharing a 2 KB system prompt" if shared_system_prompt else "with distinct prompts"
    return CaseResult(
        f"burst of {scale.burst} new sessions at once {prompts}, {replicas} replicas",
        len(outcomes),
        len(lost(outcomes)),
        None,
        "",
        f"per replica {', '.join(str(counts[r.name]) for r in gw.members)}: busiest at {worst:.2f}x its share; "
        f"p99 {_ms(percentile((o.latency_s for o in outcomes), 0.99))} ms",
        {"per_replica": dict(sorted(counts.items())), "max_over_share": round(worst, 2)},
    )


def processor_rss(gw: LocalGateway, index: int = 0) -> int | None:
    """The processor's resident memory in bytes (VmRSS), None when it is not running."""
    proc = gw.procs.procs.get(gw.processor_name(index))
    return rss_bytes(proc.pid) if proc is not None and proc.poll() is None else None


def rss_bytes(pid: int) -> int | None:
    """A process's resident memory from ``/proc/<pid>/status`` (VmRSS), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --- the table ----------------------------------------------------------------------------------


def markdown_table(rows: list[CaseResult]) -> str:
    """The results as a markdown table: case, requests, lost, time to recover, what was seen."""
    lines = [
        "| case | requests | lost | time to recover | what it showed |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        recover = f"{r.recover_s:.2f} s ({r.recover_what})" if r.recover_s is not None else "n/a"
        if r.recover_s is None and r.recover_what:
            recover = f"not reached ({r.recover_what})"
        lines.append(f"| {r.case} | {r.requests:,} | {r.lost:,} | {recover} | {r.notes} |")
    return "\n".join(lines) + "\n"
