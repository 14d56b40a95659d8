"""A hung replica (accepts connections, never answers) through real Envoy, the processor and fake
replicas: requests that had nothing back yet are retried on another replica after their try's
budget (a stream's first-byte timeout; a non-streaming request's, from its max_tokens and capped
by upstream.unary_max_s, also without max_tokens), a stream that stalls after its headers ends
with an error after the idle timeout, and the processor takes the replica out of the rotation from
the tries that timed out. A healthy non-streaming answer that outlasts its budget is raced by a
second try (a hedge), never cut."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import aiohttp
import pytest

from extproc_lab.demo import fault_matrix as fm
from extproc_lab.demo.fault_matrix import with_config
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import Outcome, chat_body, read_metrics, send, send_stream, total
from tests.conftest import require_binary
from tests.helpers import SLACK_S, assert_every_shape_answered_within_its_budget, metrics_page, scrape_total

pytestmark = pytest.mark.e2e
FIRST_BYTE_S = 0.5
STREAM_IDLE_S = 1.6  # > 3 tries x 0.5 s: the idle timer also runs before the headers
ROUTE_TIMEOUT_S = 30  # far above what the per-try bounds allow, so a request that waited for it shows
CONFIG = (
    "health:\n  cooldown_s: 1.0\n"
    f"upstream:\n  first_byte_s: {FIRST_BYTE_S}\n  stream_idle_s: {STREAM_IDLE_S}\n"
    "  unary_s_per_output_token: 0.01\n"
)


async def prefills_counted(http: aiohttp.ClientSession, gw: LocalGateway) -> float:
    """Prefills the replicas have counted (their time-to-first-token observations), all together."""
    pages = [await metrics_page(http, f"http://{r.address}/metrics") for r in gw.members]
    return sum(scrape_total(page, "vllm:time_to_first_token_seconds_count") for page in pages)


async def in_rotation(http: aiohttp.ClientSession, url: str, replica: str) -> bool:
    async with http.get(url) as resp:
        return f'extproc_replica_in_rotation{{replica="{replica}"}} 1.0' in await resp.text()


@pytest.mark.parametrize("mode", ["cluster", "endpoint"])
def test_hung_replica_costs_the_first_byte_timeout_not_the_route_timeout(mode: str) -> None:
    require_binary("envoy")
    gw = LocalGateway(
        replicas=3,
        mode=mode,
        # Real time: a 400-token stream lasts about 2 s, long enough to stall it in the middle.
        time_scale=1.0,
        envoy_options={
            "route_timeout_s": ROUTE_TIMEOUT_S,
            "first_byte_timeout_s": FIRST_BYTE_S,
            "stream_idle_timeout_s": STREAM_IDLE_S,
        },
    )
    with_config(gw, CONFIG)
    stopped = 0
    try:
        gw.start()
        stopped, unary, streams, stopped_at, ejected = asyncio.run(_scenario(gw))
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        gw.stop()
    victim = streams[0].replica
    # Non-streaming turns of sessions pinned to the hung replica: nothing came back from it, so
    # Envoy retried each on another replica after the first-byte timeout; none was lost.
    assert unary and all(o.ok for o in unary), [(o.status, o.error) for o in unary]
    assert all(o.replica != victim for o in unary)
    assert all(FIRST_BYTE_S * 0.9 <= o.latency_s < FIRST_BYTE_S + SLACK_S for o in unary), [
        round(o.latency_s, 2) for o in unary
    ]
    # Streams flowing from it when it hung: they cannot be retried (the client has bytes), so they
    # end with an error soon after the idle timeout instead of at the route timeout.
    assert all(not o.ok and o.status == 200 for o in streams), [(o.status, o.error) for o in streams]
    assert all(o.ended - stopped_at < STREAM_IDLE_S + SLACK_S for o in streams), [
        round(o.ended - stopped_at, 2) for o in streams
    ]
    assert ejected is not None and ejected - stopped_at < SLACK_S + 2.0


async def _scenario(gw: LocalGateway) -> tuple[int, list[Outcome], list[Outcome], float, float | None]:
    async with aiohttp.ClientSession() as http:
        warm = await asyncio.gather(*(send(http, gw.url, f"s{i}", 0, chat_body(f"hello {i}")) for i in range(12)))
        assert all(o.ok for o in warm)
        victim = warm[0].replica
        pinned = [o.session for o in warm if o.replica == victim]
        started: asyncio.Queue[str] = asyncio.Queue()
        body = json.dumps(
            {
                "model": "demo-model",
                "stream": True,
                "max_tokens": 400,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "tell me a long story"}],
            }
        ).encode()
        streams = [
            asyncio.create_task(
                send_stream(
                    http,
                    gw.url,
                    session,
                    body,
                    timeout_s=ROUTE_TIMEOUT_S + 5,
                    on_headers=lambda s, r: started.put_nowait(r),
                )
            )
            for session in pinned[:2]
        ]
        # Both streams have their headers (from the victim: their sessions are pinned there).
        for _ in streams:
            await asyncio.wait_for(started.get(), 10.0)
        pid = gw.procs.procs[victim].pid
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        unary = await asyncio.gather(
            *(send(http, gw.url, s, 1, chat_body(f"hello {s} again"), timeout_s=ROUTE_TIMEOUT_S + 5) for s in pinned)
        )
        done = await asyncio.gather(*streams)
        ejected = None
        deadline = stopped_at + 10.0
        while time.monotonic() < deadline:
            if not await in_rotation(http, gw.metrics_url, victim):
                ejected = time.monotonic()
                break
            await asyncio.sleep(0.05)  # real time: the gateway's scrapes eject the hung engine
        return pid, list(unary), list(done), stopped_at, ejected


def test_a_long_non_streaming_answer_is_not_cut_at_the_first_byte_timeout() -> None:
    """Its first byte is its last: the processor's per-request bound (max_tokens x the per-token
    budget) replaces the route's first-byte timeout, so a healthy replica's long answer is neither
    cut nor sent twice."""
    require_binary("envoy")
    gw = LocalGateway(
        replicas=2,
        time_scale=1.0,  # 400 tokens at the demo profile's 5 ms: about 2 s, four first-byte timeouts
        envoy_options={"first_byte_timeout_s": FIRST_BYTE_S, "stream_idle_timeout_s": STREAM_IDLE_S},
    )
    with_config(gw, CONFIG)
    body = json.dumps(
        {
            "model": "demo-model",
            "max_tokens": 400,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer, not streamed"}],
        }
    ).encode()

    async def scenario() -> tuple[Outcome, float]:
        async with aiohttp.ClientSession() as http:
            outcome = await send(http, gw.url, "long", 0, body, timeout_s=30)
            return outcome, await prefills_counted(http, gw)

    with gw:
        outcome, prefills = asyncio.run(scenario())
    assert outcome.ok, outcome
    assert outcome.latency_s > 4 * FIRST_BYTE_S  # it did outlast the route's first-byte timeout
    assert prefills == 1  # one try: no replica was asked a second time


def test_every_request_shape_on_a_hung_replica_is_answered_elsewhere_within_its_budget() -> None:
    """Chat and completions, streamed and not, without max_tokens, with a small one and a huge one,
    all sent at once to the sessions of a replica that just hung (endpoint mode here, without
    Envoy's health checks; tests/e2e/test_fault_matrix.py runs the failover scenario). Before the
    non-streaming budget had a cap, those without max_tokens or with a huge one waited for the
    route timeout and got a 504."""
    require_binary("envoy")
    scale = fm.SMALL
    row = asyncio.run(fm.replica_hung_every_shape(scale, mode="endpoint", health_check_path=None))
    assert_every_shape_answered_within_its_budget(row, scale)


def test_a_non_streaming_answer_past_its_budget_is_raced_not_cut() -> None:
    """A healthy replica's long non-streaming answer (2 s) outlasts its try's budget (unary_max_s
    1.2 s): Envoy asks another replica too (a hedge), keeps the first try, and the first answer
    wins. Envoy counts two attempts, but the answer came from the chosen replica (the address Envoy
    adds tells the processor), so it is not that replica's failure: three in a row would eject it."""
    require_binary("envoy")
    gw = LocalGateway(
        replicas=3,
        time_scale=1.0,
        envoy_options={"first_byte_timeout_s": FIRST_BYTE_S, "stream_idle_timeout_s": STREAM_IDLE_S},
    )
    with_config(gw, CONFIG + "  unary_max_s: 1.2\n")
    body = json.dumps(
        {
            "model": "demo-model",
            "max_tokens": 400,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer, raced"}],
        }
    ).encode()

    async def scenario() -> tuple[list[Outcome], float, float]:
        async with aiohttp.ClientSession() as http:
            outcomes = [await send(http, gw.url, "raced", turn, body, timeout_s=30) for turn in range(3)]
            await asyncio.sleep(1.0)  # the processor's next evaluation (an ejection is counted there)
            ejections = total(await read_metrics(http, gw.metrics_url), "extproc_replica_ejections_total")
            return outcomes, await prefills_counted(http, gw), ejections

    with gw:
        outcomes, prefills, ejections = asyncio.run(scenario())
    assert all(o.ok for o in outcomes), outcomes
    # The session's replica answered each time: its try was not cut (a cut try's request would
    # have been answered by another replica, 1.2 s + 2 s later).
    assert len({o.replica for o in outcomes}) == 1, outcomes
    assert prefills >= 2 * len(outcomes)  # hedged: another replica was asked each time too
    assert ejections == 0  # the chosen replica's own answers after a hedge are not its failures
