"""The Redis store beyond the shared contract: sharing between gateways, TTLs as Redis keeps them,
the near-cache, Redis dying or hanging and coming back, and every URL form against a real server."""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import NodesManager, RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.app.router import Router
from extproc.observe.metrics import RouterMetrics
from extproc.routing.model import Reason
from extproc.state.factory import open_store
from extproc.state.near_cache import NearCache
from extproc.state.redis_background import QueuedWrite
from extproc.state.redis_keys import KeySpace
from extproc.state.redis_store import RedisStore
from extproc_lab.demo.processes import ProcessGroup
from extproc_lab.demo.redis_server import LocalRedis, LocalSentinel
from tests.conftest import chat_body, make_config, require_binary

_namespaces = itertools.count()
CHAT = "/v1/chat/completions"


class RecordingObserver:
    """A StoreObserver that remembers what it was told."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.latencies: Counter[str] = Counter()
        self.availability: list[bool] = []
        self.queued: list[int] = []

    def store_error(self, operation: str) -> None:
        self.errors[operation] += 1

    def store_latency(self, operation: str, seconds: float) -> None:
        self.latencies[operation] += 1

    def store_available(self, available: bool) -> None:
        self.availability.append(available)

    def store_queued(self, writes: int) -> None:
        self.queued.append(writes)


def redis_store(
    url: str, observer: RecordingObserver | None = None, ttl_s: float = 60.0, **options: object
) -> RedisStore:
    """A store on ``url`` with URL options, in a namespace of its own."""
    query = "&".join(f"{k}={v}" for k, v in options.items())
    store = open_store(
        f"{url}{'&' if '?' in url else '?'}{query}" if query else url,
        ttl_s=ttl_s,
        namespace=f"redis-test-{next(_namespaces)}",
        observer=observer,
    )
    assert isinstance(store, RedisStore)
    return store


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="extproc-redis-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def own_redis(directory: Path) -> Iterator[LocalRedis]:
    """A redis-server of this test's own, to kill, hang or restart."""
    require_binary("redis-server")
    with ProcessGroup(directory) as procs:
        yield LocalRedis(procs, directory).start()


@pytest.fixture
async def pair(redis_server: LocalRedis) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two gateways' stores on one Redis and one namespace; the second has no near-cache."""
    namespace = f"pair-{next(_namespaces)}"
    a = open_store(redis_server.url, ttl_s=30, namespace=namespace)
    b = open_store(f"{redis_server.url}?near_cache_ttl=0", ttl_s=30, namespace=namespace)
    assert isinstance(a, RedisStore) and isinstance(b, RedisStore)
    yield a, b
    await a.close()
    await b.close()


async def test_one_gateway_sees_what_another_routed(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await a.record("conv", "r2", [11, 12, 13], now=0, pin=True, model="m")
    assert await a.flush()
    view = await b.lookup("conv", [11, 12, 13, 14], now=0, model="m")
    assert view.pinned == "r2" and dict(view.prefix_matches) == {"r2": 3}
    assert b.counters.remote_lookups == 1


async def test_a_lookup_slides_the_session_ttl_in_the_same_round_trip(
    pair: tuple[RedisStore, RedisStore], redis_server: LocalRedis
) -> None:
    a, b = pair
    await a.record("conv", "r1", [], now=0, pin=True, model="m")
    assert await a.flush()
    key = b.keys.session("m", "conv")
    with redis_server.client() as c:
        assert 29_000 < c.pttl(key) <= 30_000
        c.pexpire(key, 1000)  # as if the session had been idle for 29 s
        await b.lookup("conv", [], now=0, model="m")
        assert c.pttl(key) > 29_000


async def test_sessions_and_prefixes_expire_in_redis_when_idle(redis_server: LocalRedis) -> None:
    store = redis_store(redis_server.url, ttl_s=0.3)
    try:
        await store.record("conv", "r1", [1, 2], now=0, pin=True, model="m")
        assert await store.flush()
        with redis_server.client() as c:
            keys = [store.keys.session("m", "conv"), store.keys.prefix_index("m", "r1"), store.keys.replicas("m")]
            assert c.exists(*keys) == 3
            await asyncio.sleep(0.45)  # real time: the TTLs expire on the real Redis's clock
            assert c.exists(*keys) == 0
    finally:
        await store.close()


def test_keys_of_one_model_share_a_cluster_hash_tag() -> None:
    keys = KeySpace("prod/eu{1}")
    tag = keys.tag("meta-llama/Llama-3{x}")
    names = [keys.session("meta-llama/Llama-3{x}", "s{odd}"), keys.replicas("meta-llama/Llama-3{x}")]
    names.append(keys.prefix_index("meta-llama/Llama-3{x}", "r1"))
    hash_tags = {n[n.index("{") + 1 : n.index("}")] for n in names}
    assert len(hash_tags) == 1 and all(n.startswith(tag) for n in names)
    assert keys.tag("a") != keys.tag("b") and KeySpace("other").tag("a") != keys.tag("a")


async def test_the_near_cache_answers_a_hot_session_without_redis(redis_server: LocalRedis) -> None:
    store = redis_store(redis_server.url, near_cache_ttl=5)
    try:
        await store.record("agent", "r1", [1, 2], now=0, pin=True, model="m")
        for i in range(20):
            view = await store.lookup("agent", [1, 2, 3], now=i * 0.1, model="m")
            assert view.pinned == "r1" and dict(view.prefix_matches) == {"r1": 2}
        assert store.counters.near_hits == 20 and store.counters.remote_lookups == 0
        # Older than the near-cache TTL: Redis is asked again (and the answer cached again).
        assert (await store.lookup("agent", [], now=10, model="m")).pinned == "r1"
        assert store.counters.remote_lookups == 1
    finally:
        await store.close()


async def test_two_gateways_that_disagree_converge_within_the_near_cache_ttl(redis_server: LocalRedis) -> None:
    # As after an outage, each gateway pinned the conversation on its own: both near-caches hold
    # their own answer. Every 0.3 s each routes a turn on what it sees and records that; their own
    # writes must not keep their answers alive past the near-cache's second.
    namespace = f"diverged-{next(_namespaces)}"
    a, b = (open_store(f"{redis_server.url}?near_cache_ttl=1", ttl_s=30, namespace=namespace) for _ in range(2))
    assert isinstance(a, RedisStore) and isinstance(b, RedisStore)
    try:
        await a.record("conv", "r1", [], now=0, pin=True, model="m")
        await b.record("conv", "r2", [], now=0, pin=True, model="m")
        assert await a.flush() and await b.flush()
        seen: list[tuple[str | None, str | None]] = []
        for step in range(1, 8):
            now = step * 0.3
            views = [await store.lookup("conv", [], now=now, model="m") for store in (a, b)]
            seen.append((views[0].pinned, views[1].pinned))
            for store, view in zip((a, b), views, strict=True):
                assert view.pinned is not None
                await store.record("conv", view.pinned, [], now=now, pin=True, model="m")
                assert await store.flush()
        assert seen[0] == ("r1", "r2")
        assert all(x == y for x, y in seen[4:]), seen  # from 1.5 s on: both read Redis's one pin
    finally:
        await a.close()
        await b.close()


async def test_a_gateway_reads_its_own_pin_while_its_write_waits_to_reach_redis(
    redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = redis_store(redis_server.url, near_cache_ttl=1)
    release = asyncio.Event()
    try:
        await store.record("conv", "r1", [], now=0, pin=True, model="m")
        assert await store.flush()
        send = store._write_batch

        async def held(batch: list[QueuedWrite]) -> None:  # an outage's backlog, still draining
            await release.wait()
            await send(batch)

        monkeypatch.setattr(store, "_write_batch", held)
        await store.record("conv", "r2", [], now=5, pin=True, model="m")  # moved: a failover
        # The near-cache's entry from 5 s has expired: the lookup reads Redis, which says r1.
        view = await store.lookup("conv", [], now=6.5, model="m")
        assert store.counters.remote_lookups == 1
        assert view.pinned == "r2"
        release.set()
        assert await store.flush()
        assert store.unsent_pin(store.keys.session("m", "conv")) is None
        assert (await store.lookup("conv", [], now=8, model="m")).pinned == "r2"  # Redis's, now
        assert store.counters.remote_lookups == 2
    finally:
        release.set()
        await store.close()


def test_near_cache_entries_do_not_slide_and_the_cache_is_bounded() -> None:
    near = NearCache(ttl_s=1.0, max_entries=3)
    near.put("a", "r1", now=0)
    assert near.get("a", now=0.9) == "r1"
    assert near.get("a", now=1.0) is None  # reading did not extend it
    near.put("a", "r1", now=2)
    near.write("a", "r3", now=2.5)  # this gateway's own pin: answered at once, not extended
    assert near.get("a", now=2.9) == "r3" and near.get("a", now=3.0) is None
    for key in "bcde":
        near.put(key, "r2", now=2)
    assert len(near) == 3 and near.get("b", now=2) is None
    near.drop_replica("r2")
    assert len(near) == 0
    off = NearCache(ttl_s=0)
    off.put("a", "r1", now=0)
    assert off.get("a", now=0) is None


async def test_routing_carries_on_when_redis_dies_and_writes_resume_when_it_returns(
    own_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    observer = RecordingObserver()
    store = redis_store(own_redis.url, observer, near_cache_ttl=0)
    store.outage.max_delay_s = 0.2
    try:
        await store.record("before", "r1", [1, 2, 3], now=0, pin=True, model="m")
        assert await store.flush()
        own_redis.kill()
        caplog.set_level(logging.WARNING, "extproc.state")
        start = time.perf_counter()
        worst = 0.0
        for i in range(200):
            t = time.perf_counter()
            view = await store.lookup("before", [1, 2, 3], now=i, model="m")
            worst = max(worst, time.perf_counter() - t)
            assert view.pinned == "r1" and dict(view.prefix_matches) == {"r1": 3}
            await store.record(f"during-{i}", "r2", [7], now=i, pin=True, model="m")
        elapsed = time.perf_counter() - start
        assert worst < 0.1 and elapsed < 1.0, (worst, elapsed)  # no timeout paid per call
        assert not store.available and observer.availability == [False]
        assert observer.errors["lookup"] == 1  # one failed call; the rest never tried a dead Redis
        unavailable = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(unavailable) == 1  # logged once per episode
        assert observer.queued[-1] == 200  # the backlog is seen growing while Redis is away

        own_redis.start()
        assert await store.wait_available(5.0)
        assert observer.availability == [False, True]
        assert await store.flush(2.0)
        assert observer.queued[-1] == 0  # and drained once it is back
        with own_redis.client() as c:
            # Written during the outage, sent when Redis returned (a fresh Redis: nothing else).
            assert c.get(store.keys.session("m", "during-199")) == b"r2"
            assert c.get(store.keys.session("m", "before")) is None
        await store.record("after", "r3", [], now=300, pin=True, model="m")
        assert await store.flush()
        with own_redis.client() as c:
            assert c.get(store.keys.session("m", "after")) == b"r3"
        # Lookups go to Redis again (its scripts were loaded anew after the restart).
        remote = store.counters.remote_lookups
        assert (await store.lookup("after", [], now=301, model="m")).pinned == "r3"
        assert store.counters.remote_lookups == remote + 1
    finally:
        await store.close()


async def test_a_hung_redis_costs_one_short_timeout_not_one_per_request(own_redis: LocalRedis) -> None:
    store = redis_store(own_redis.url, near_cache_ttl=0)
    try:
        await store.record("s", "r1", [1], now=0, pin=True, model="m")
        assert await store.flush()
        own_redis.pause()
        t = time.perf_counter()
        assert (await store.lookup("s", [1], now=1, model="m")).pinned == "r1"
        first = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(100):
            assert (await store.lookup("s", [1], now=2 + i, model="m")).pinned == "r1"
        rest = time.perf_counter() - t
        assert 0.04 <= first < 0.3, first  # the 50 ms socket timeout, not Envoy's 1 s
        assert rest < 0.2, rest
        own_redis.resume()
        assert await store.wait_available(5.0)
        # The reply the timed-out call never read must not be taken for a later call's.
        await store.record("t", "r2", [2], now=200, pin=True, model="m")
        assert await store.flush()
        remote = store.counters.remote_lookups
        for session, replica in (("s", "r1"), ("t", "r2"), ("s", "r1")):
            assert (await store.lookup(session, [], now=201, model="m")).pinned == replica
        assert store.counters.remote_lookups == remote + 3
    finally:
        own_redis.resume()
        await store.close()


async def test_a_flushed_script_cache_is_reloaded_without_an_error(redis_server: LocalRedis) -> None:
    observer = RecordingObserver()
    store = redis_store(redis_server.url, observer, near_cache_ttl=0)
    try:
        with redis_server.client() as c:
            c.script_flush()
        await store.record("s", "r1", [4, 5], now=0, pin=True, model="m")
        assert await store.flush()
        with redis_server.client() as c:
            c.script_flush()
        view = await store.lookup("s", [4, 5], now=0, model="m")
        assert view.pinned == "r1" and store.counters.remote_lookups == 1
        assert not observer.errors and store.available
    finally:
        await store.close()


async def test_two_routers_on_one_redis_keep_a_session_on_one_replica(pair: tuple[RedisStore, RedisStore]) -> None:
    # Two gateways with different loads: the second would place the session elsewhere on its own.
    gateways = [Router(make_config(), store=store) for store in pair]
    gateways[1].replicas.begin("r0", 0.0, 0)
    turns = []
    for turn in range(6):
        router = gateways[turn % 2]
        routed = await router.route(
            {":path": CHAT, "x-session-id": "shared"}, chat_body("a long conversation " * 20 + str(turn))
        )
        assert routed.decision.replica is not None
        turns.append((routed.decision.replica.name, routed.decision.reason))
        router.release(routed)
        await pair[turn % 2].flush()
    assert len({replica for replica, _ in turns}) == 1
    assert [reason for _, reason in turns[1:]] == [Reason.STICKY] * 5


async def test_metrics_report_store_errors_latency_and_availability(own_redis: LocalRedis) -> None:
    metrics = RouterMetrics()
    store = open_store(f"{own_redis.url}?near_cache_ttl=0", namespace="metrics", observer=metrics)
    router = Router(make_config(), store=store, metrics=metrics)
    try:
        await router.route({":path": CHAT, "x-session-id": "m"}, chat_body("hello " * 30))
        own_redis.kill()
        await router.route({":path": CHAT, "x-session-id": "m"}, chat_body("hello " * 30))
        reg = metrics.registry
        assert reg.get_sample_value("extproc_store_errors_total", {"operation": "lookup"}) == 1
        assert reg.get_sample_value("extproc_store_available") == 0
        assert reg.get_sample_value("extproc_store_duration_seconds_count", {"operation": "lookup"}) == 1
    finally:
        await store.close()


async def test_unix_socket_url(redis_server: LocalRedis) -> None:
    store = redis_store(redis_server.unix_url, near_cache_ttl=0)
    try:
        await store.record("s", "r1", [9], now=0, pin=True)
        assert await store.flush()
        assert (await store.lookup("s", [9], now=0)).pinned == "r1"
        assert store.counters.remote_lookups == 1 and store.available
    finally:
        await store.close()


async def test_password_from_a_file_and_a_wrong_one_never_logged(
    directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_binary("redis-server")
    secret = directory / "redis-password"
    secret.write_text("s3cret-pass\n")
    with ProcessGroup(directory) as procs:
        server = LocalRedis(procs, directory, password="s3cret-pass").start()
        good = redis_store(f"{server.url}?password_file={secret}", near_cache_ttl=0)
        bad = redis_store(f"redis://:wrong-pass@127.0.0.1:{server.port}", near_cache_ttl=0)
        caplog.set_level(logging.DEBUG, "extproc")
        try:
            await good.record("s", "r1", [], now=0, pin=True)
            assert await good.flush()
            assert (await good.lookup("s", [], now=0)).pinned == "r1" and good.counters.remote_lookups == 1
            assert (await bad.lookup("s", [], now=0)).pinned is None and not bad.available
            assert "wrong-pass" not in caplog.text and "s3cret" not in caplog.text
            assert "wrong-pass" not in repr(bad)
        finally:
            await good.close()
            await bad.close()


async def test_a_one_node_cluster_serves_lookups_and_pipelined_writes(directory: Path) -> None:
    require_binary("redis-server")
    with ProcessGroup(directory) as procs:
        cluster = LocalRedis(procs, directory, name="cluster", cluster=True).start()
        writer = redis_store(cluster.url)
        reader = redis_store(f"{cluster.url}?near_cache_ttl=0&namespace={writer.keys.namespace}")
        reader.keys = writer.keys
        try:
            for model in ("m1", "m2"):
                await writer.record("s", "r1", [1, 2, 3], now=0, pin=True, model=model)
            assert await writer.flush()
            for model in ("m1", "m2"):
                view = await reader.lookup("s", [1, 2, 3], now=0, model=model)
                assert view.pinned == "r1" and dict(view.prefix_matches) == {"r1": 3}
            await writer.forget_replica("r1")
            assert dict((await reader.lookup(None, [1, 2, 3], now=0, model="m2")).prefix_matches) == {}
            assert writer.available and reader.available and not writer.counters.errors
        finally:
            await writer.close()
            await reader.close()


async def test_a_cluster_slower_to_discover_than_an_operation_is_still_written(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Discovering the slots and the command table takes a few round trips and a large COMMAND
    # reply; on a busy machine it overran the per-operation budget and the first writes failed.
    require_binary("redis-server")
    with ProcessGroup(directory) as procs:
        cluster = LocalRedis(procs, directory, name="cluster", cluster=True).start()
        store = redis_store(cluster.url, near_cache_ttl=0)
        assert isinstance(store.client, RedisCluster)
        discover = NodesManager.initialize

        async def slow_discovery(self: NodesManager) -> None:
            # real time: a discovery slower than the real client's timeout
            await asyncio.sleep(store.op_timeout_s * 1.5)
            await discover(self)

        monkeypatch.setattr(NodesManager, "initialize", slow_discovery)
        try:
            await store.record("s", "r1", [1, 2], now=0, pin=True, model="m")
            assert await store.flush(3.0)
            assert store.available and not store.counters.errors
            assert (await store.lookup("s", [1, 2], now=0, model="m")).pinned == "r1"
        finally:
            await store.close()


async def test_a_first_connection_slower_than_an_operation_is_still_written(
    own_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening the first connection (connect, handshake) overran the per-operation budget on a
    # busy CI machine: the first write timed out and started an outage. The writer now opens it
    # first, retrying timeouts for a while, off the request path.
    store = redis_store(own_redis.url, near_cache_ttl=0)
    connect = Connection.connect
    slowed: list[bool] = []

    async def slow_first_connect(self: Connection) -> None:
        if not slowed:
            slowed.append(True)
            raise RedisTimeoutError("Timeout connecting to server")
        await connect(self)

    monkeypatch.setattr(Connection, "connect", slow_first_connect)
    try:
        await store.record("s", "r1", [1, 2], now=0, pin=True, model="m")
        assert await store.flush(3.0)
        assert slowed and store.available and not store.counters.errors
        assert (await store.lookup("s", [1, 2], now=0, model="m")).pinned == "r1"
    finally:
        await store.close()


async def test_the_master_behind_a_sentinel(directory: Path) -> None:
    require_binary("redis-server")
    with ProcessGroup(directory) as procs:
        master = LocalRedis(procs, directory, name="master").start()
        sentinel = LocalSentinel(procs, directory, master).start()
        store = redis_store(sentinel.url, near_cache_ttl=0)
        try:
            await store.record("s", "r1", [5, 6], now=0, pin=True)
            assert await store.flush()
            view = await store.lookup("s", [5, 6], now=0)
            assert view.pinned == "r1" and store.counters.remote_lookups == 1
            with master.client() as c:
                assert c.get(store.keys.session("", "s")) == b"r1"
        finally:
            await store.close()
