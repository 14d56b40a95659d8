"""Shared state on the Redis deployments people run, each with the active-active e2e of
``test_shared_store_e2e``: Envoy round-robins ext_proc streams over two processors that share
Redis, so a conversation's turns alternate processors and must stay on one replica.

- TLS: ``rediss://`` to a redis-server serving TLS only, with a CA made for the test.
- Sentinel: a master, its replica and a Sentinel; the master is SIGKILLed mid-replay, the
  Sentinel promotes the replica, and the processors find the new master through it.
- Cluster: three shards; conversations of several models, whose hash tags land on every shard.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from redis.crc import key_slot

from extproc.state.redis_keys import KeySpace
from extproc_lab.demo.certificates import make_certificates
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from extproc_lab.demo.redis_server import LocalCluster, LocalRedis, LocalSentinel
from extproc_lab.demo.workload import Conversation, multi_turn
from tests.conftest import require_binary
from tests.helpers import decisions, send_turn

pytestmark = pytest.mark.e2e
NAMESPACE = "topo"
# The first burst of requests opens a connection each: over TLS, Python's handshakes on two busy
# cores outlast the 50 ms default timeouts (measured: lookups timed out, the store routed on local
# state for 0.1 s and 4 of 10 conversations changed replica), and 0.5 s was still too short at a
# load average of 8.7. Connections are pooled, so only a cold start pays for the handshakes; a
# deployment over TLS should give itself the same room (docs/shared-state.md). A Cluster's slot discovery too.
TLS_ROOMY = "connect_timeout=2&socket_timeout=0.5"
ROOMY = "connect_timeout=0.5&socket_timeout=0.5"
# Pins are written behind the decision; a user's next turn comes seconds later, not within the
# write's latency (a Cluster's first write to a node loads the script there): a pause between
# turns, or a turn could race the write of the one before it on the other processor. 0.1 s was
# too short for the Cluster at a load average of about 8 (2 of 5 runs had a conversation move).
THINK_S = 0.3


def gateway(store_url: str) -> LocalGateway:
    return LocalGateway(replicas=3, time_scale=0.02, processors=2, processor_args=("--store", store_url))


@contextmanager
def running(gw: LocalGateway, *redis: LocalRedis) -> Iterator[LocalGateway]:
    try:
        for server in redis:
            server.start()
        yield gw
    finally:
        gw.stop()  # the Redis processes are in the gateway's process group: stopped by PID


async def replay(
    gw: LocalGateway, convs: list[Conversation], turns: int, models: list[str] | None = None
) -> tuple[list[set[str]], list[Counter[str]], Counter[int]]:
    """Every conversation's turns in order, all conversations at once; returns the replicas each
    used, the decisions per processor during the replay, and the statuses."""
    statuses: Counter[int] = Counter()
    async with aiohttp.ClientSession() as http:
        before = await decisions(http, gw.metrics_urls)

        async def converse(index: int, conv: Conversation) -> set[str]:
            used = set()
            for t in range(turns):
                model = models[index % len(models)] if models else "demo-model"
                status, replica = await send_turn(http, gw.url, conv, t, model)
                statuses[status] += 1
                used.add(replica)
                await asyncio.sleep(THINK_S)  # real time: a client's think time between turns
            return used

        used = await asyncio.gather(*(converse(i, c) for i, c in enumerate(convs)))
        after = await decisions(http, gw.metrics_urls)
    return list(used), [after[i] - before[i] for i in range(2)], statuses


def assert_shared(used: list[set[str]], per_processor: list[Counter[str]], statuses: Counter[int], turns: int) -> None:
    total = len(used) * turns
    assert statuses == {200: total}, statuses
    assert all(len(u) == 1 for u in used), used
    # Both processors decided, and every turn after the first found the pin the other one wrote.
    assert min(sum(c.values()) for c in per_processor) >= total // 4, per_processor
    assert sum(c["sticky"] for c in per_processor) == total - len(used), per_processor


def test_tls_redis_shared_by_two_processors(tmp_path: Any) -> None:
    require_binary("envoy")
    require_binary("redis-server")
    require_binary("openssl")
    certs = make_certificates(tmp_path / "certs")
    gw = gateway("placeholder")
    server = LocalRedis(gw.procs, gw.dir, name="redis-tls", tls=certs)
    gw.processor_args = ("--store", f"{server.url}&namespace={NAMESPACE}&{TLS_ROOMY}")
    with running(gw, server):
        gw.start()
        convs = multi_turn(10, 6, seed=5, system_tokens=100, document_tokens=300, run_id="tls")
        used, per_processor, statuses = asyncio.run(replay(gw, convs, 6))
        with server.client() as c:  # over TLS too: the plain port is off
            pins = list(c.scan_iter(match=f"ext:{{{NAMESPACE}/*}}:s:*", count=1000))
    assert_shared(used, per_processor, statuses, 6)
    assert len(pins) == 10


SENTINEL_TURNS = 24  # conversations outlast the promotion and the stores' recovery with turns to spare
SENTINEL_THINK_S = 0.4  # the replay spans the kill, the promotion (~2 s) and turns after it
SETTLE_S = 1.0  # the near-cache's TTL (RedisStore's near_cache_ttl_s): a pin read before the drain lives that long


@dataclass
class Turn:
    session: str
    started: float
    replica: str


def test_sentinel_failover_mid_replay_loses_no_request_and_sessions_stay() -> None:
    require_binary("envoy")
    require_binary("redis-server")
    gw = gateway("placeholder")
    master = LocalRedis(gw.procs, gw.dir, name="redis-master")
    replica = LocalRedis(gw.procs, gw.dir, name="redis-replica", replica_of=master)
    sentinel = LocalSentinel(gw.procs, gw.dir, master, down_after_ms=1000)
    gw.processor_args = ("--store", f"{sentinel.url}?namespace={NAMESPACE}")
    with running(gw, master, replica):
        sentinel.start()
        gw.start()
        result = asyncio.run(_failover(gw, master, replica, sentinel))
    statuses, turns, killed, promoted, recovered, pins, last = result
    assert statuses == {200: 8 * SENTINEL_TURNS}, statuses
    assert promoted is not None and promoted - killed < 15, (killed, promoted)
    # Both processors found the promoted master through the Sentinel and read and write it again.
    assert recovered is not None, "a processor's store never came back"
    before = _replicas_per_session(t for t in turns if t.started < killed)
    after = _replicas_per_session(t for t in turns if t.started > recovered + SETTLE_S)
    # Sticky before the kill, and sticky again once the new master serves both processors: every
    # conversation's later turns on one replica, the one its pin in the promoted master names.
    # (While no master answers, each processor routes on its own memory; a turn that lands on the
    # processor that did not pin it may move. The pins the two wrote meanwhile then drain into the
    # new master, the last write winning, and a near-cached pin lives out its second: that window,
    # from the kill until both backlogs drained plus the near-cache's TTL, is the price of the
    # failover; a CI run at a high load average saw a conversation move inside it.)
    timeline = [(t.session, round(t.started - killed, 2), t.replica) for t in turns]
    assert all(len(r) == 1 for r in before.values()), (before, timeline)
    assert len(after) == 8 and all(len(r) == 1 for r in after.values()), (after, recovered - killed, timeline)
    assert pins == last == {s: next(iter(r)) for s, r in after.items()}


def _replicas_per_session(turns: Iterable[Turn]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in turns:
        out.setdefault(t.session, set()).add(t.replica)
    return out


async def _store_settled(http: aiohttp.ClientSession, gw: LocalGateway) -> bool:
    """Every processor's store in use again, with no write from the outage still waiting."""
    pages = [await read_metrics(http, url) for url in gw.metrics_urls]
    return all(m.get("extproc_store_available{}") == 1.0 and m.get("extproc_store_queued_writes{}") == 0 for m in pages)


async def _failover(
    gw: LocalGateway, master: LocalRedis, replica: LocalRedis, sentinel: LocalSentinel
) -> tuple[Counter[int], list[Turn], float, float | None, float | None, dict[str, str], dict[str, str]]:
    convs = multi_turn(8, SENTINEL_TURNS, seed=6, system_tokens=100, document_tokens=300, run_id="sentinel")
    statuses: Counter[int] = Counter()
    turns: list[Turn] = []
    last: dict[str, str] = {}
    killed = promoted = recovered = None

    async with aiohttp.ClientSession() as http:

        async def converse(conv: Conversation) -> None:
            for t in range(SENTINEL_TURNS):
                started = time.monotonic()
                status, name = await send_turn(http, gw.url, conv, t)
                statuses[status] += 1
                turns.append(Turn(conv.session_id, started, name))
                last[conv.session_id] = name
                await asyncio.sleep(SENTINEL_THINK_S)  # real time: a client's think time between turns

        async def fail_over() -> None:
            nonlocal killed, promoted, recovered
            await asyncio.sleep(SENTINEL_TURNS * SENTINEL_THINK_S / 4)  # real time: the failover lands mid-workload
            master.kill()
            killed = time.monotonic()
            while time.monotonic() - killed < 20:
                if await asyncio.to_thread(sentinel.master_address) == ("127.0.0.1", replica.port):
                    promoted = time.monotonic()
                    break
                await asyncio.sleep(0.1)  # real time: Sentinel promoting the replica
            while time.monotonic() - killed < 30:
                if await _store_settled(http, gw):
                    recovered = time.monotonic()
                    break
                await asyncio.sleep(0.05)  # real time: the gateway finding the new master, draining its backlog

        await asyncio.gather(fail_over(), *(converse(c) for c in convs))
        assert killed is not None
        # Pins are written behind the decisions: give the last turns' writes a moment to land.
        keys = KeySpace(NAMESPACE)
        deadline = time.monotonic() + 5.0
        while True:
            with replica.client() as c:
                pins = {
                    conv.session_id: (c.get(keys.session("demo-model", conv.session_id)) or b"").decode()
                    for conv in convs
                }
            if pins == last or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)  # real time: pins settling in the real Redis
    return statuses, turns, killed, promoted, recovered, pins, last


def _models_on_every_shard(cluster: LocalCluster, keys: KeySpace) -> list[str]:
    """Model names whose hash tags land on each shard in turn (the slots are split evenly)."""
    shards = len(cluster.nodes)
    found: dict[int, str] = {}
    for i in range(1000):
        model = f"model-{i}"
        shard = key_slot(keys.session(model, "x").encode()) * shards // 16384
        found.setdefault(shard, model)
        if len(found) == shards:
            break
    return [found[s] for s in range(shards)]


def test_three_shard_cluster_shared_by_two_processors() -> None:
    require_binary("envoy")
    require_binary("redis-server")
    gw = gateway("placeholder")
    cluster = LocalCluster(gw.procs, gw.dir, shards=3)
    gw.processor_args = ("--store", f"{cluster.url}?namespace={NAMESPACE}&{ROOMY}")
    keys = KeySpace(NAMESPACE)
    models = _models_on_every_shard(cluster, keys)
    with running(gw):
        cluster.start()
        gw.start()
        convs = multi_turn(12, 5, seed=7, system_tokens=100, document_tokens=300, run_id="cluster")
        used, per_processor, statuses = asyncio.run(replay(gw, convs, 5, models))
        per_shard = cluster.keys_per_node(f"ext:{{{NAMESPACE}/*}}:s:*")
    assert_shared(used, per_processor, statuses, 5)
    assert sum(per_shard) == 12 and all(n == 4 for n in per_shard), per_shard
