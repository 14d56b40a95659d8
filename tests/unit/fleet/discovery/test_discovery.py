"""Discovery: settings, the debounced loop, DNS with a fake resolver, Kubernetes against a fake API
server that speaks list+watch. Membership is asserted on a real Router."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from extproc.app.router import Router
from extproc.base.world import ManualWorld
from extproc.config import ConfigError, config_from_mapping
from extproc.fleet.discovery import (
    DiscoveryLoop,
    DnsDiscovery,
    DnsPythonResolver,
    DnsSource,
    KubernetesDiscovery,
    KubernetesSource,
    PortChoice,
    ResolutionError,
    SliceSet,
    SrvRecord,
    StaticDiscovery,
    StaticSource,
    replicas_of_slice,
    run_discovery,
)
from extproc.fleet.discovery.kubernetes_watch import Backoff
from extproc.observe.metrics import RouterMetrics
from extproc.routing import Replica
from tests.conftest import make_config
from tests.helpers import wait_for

NAMESPACE = "llm"
SERVICE = "vllm"


def members(router: Router) -> dict[str, str]:
    return {rec.replica.name: rec.replica.address for rec in router.replicas.records()}


@contextlib.asynccontextmanager
async def running(coro: Any) -> AsyncIterator[asyncio.Task[None]]:
    """Run a coroutine as a task for the block, then cancel it and wait for its cleanup."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class RecordingRouter:
    """A membership target that records every call and forwards it to a real Router."""

    def __init__(self) -> None:
        self.router = Router(make_config(replicas=()))
        self.calls: list[list[str]] = []

    async def set_replicas(self, replicas: Sequence[Replica]) -> object:
        self.calls.append([r.name for r in replicas])
        return await self.router.fleet.set_replicas(replicas)


# --- settings -------------------------------------------------------------------------------------


def test_default_discovery_is_static() -> None:
    cfg = config_from_mapping({})
    assert cfg.discovery.is_static
    assert config_from_mapping({"discovery": None}).discovery.is_static
    assert config_from_mapping({"discovery": {"debounce_s": 2}}).discovery == StaticSource(debounce_s=2, max_delay_s=10)


def discovery(section: dict[str, object]) -> object:
    return config_from_mapping({"discovery": section}).discovery


def test_dns_and_kubernetes_settings_parse() -> None:
    dns = discovery({"type": "dns", "name": "vllm.llm.svc", "port": 8000, "interval_s": 5, "debounce_s": 0.5})
    assert dns == DnsSource(name="vllm.llm.svc", port=8000, record="A", interval_s=5.0, debounce_s=0.5)
    srv = discovery({"type": "dns", "name": "_http._tcp.vllm.llm.svc", "record": "SRV"})
    assert isinstance(srv, DnsSource) and srv.port is None
    kube = config_from_mapping({"discovery": {"type": "kubernetes", "service": "vllm", "port_name": "http"}})
    assert kube.discovery == KubernetesSource(service="vllm", port_name="http") and not kube.discovery.is_static


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"type": "consul"}, "discovery.type"),
        ({"type": "dns", "port": 8000}, "discovery.name"),
        ({"type": "dns", "name": "x"}, "discovery.port"),
        ({"type": "dns", "name": "x", "record": "SRV", "port": 80}, "discovery.port"),
        ({"type": "dns", "name": "x", "port": 70000}, "discovery.port"),
        ({"type": "dns", "name": "x", "port": 80, "record": "MX"}, "discovery.record"),
        ({"type": "dns", "name": "x", "port": 80, "interval_s": 0}, "discovery.interval_s"),
        ({"type": "dns", "name": "x", "port": 80, "service": "y"}, "discovery.service"),
        ({"type": "kubernetes"}, "discovery.service"),
        ({"type": "kubernetes", "service": "v", "port": 80, "port_name": "http"}, "discovery.port_name"),
        ({"type": "kubernetes", "service": "v", "address_type": "FQDN"}, "discovery.address_type"),
        ({"type": "kubernetes", "service": "v", "debounce_s": 5, "max_delay_s": 1}, "discovery.max_delay_s"),
        ({"type": "static", "debounce_s": "soon"}, "discovery.debounce_s"),
    ],
)
def test_discovery_errors_name_the_field(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_mapping({"discovery": section})


# --- the loop ---------------------------------------------------------------------------------------


class ScriptedSource:
    """A source that yields what the test puts in its queue (None ends it, an exception raises)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Sequence[Replica] | Exception | None] = asyncio.Queue()
        self.starts = 0

    async def updates(self) -> AsyncIterator[Sequence[Replica]]:
        self.starts += 1
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item


def fleet(*names: str) -> list[Replica]:
    return [Replica(n, f"127.0.1.{i + 1}:8000") for i, n in enumerate(names)]


async def test_loop_applies_the_first_list_at_once_and_debounces_changes() -> None:
    source, target, world = ScriptedSource(), RecordingRouter(), ManualWorld()
    loop = DiscoveryLoop(source, target, debounce_s=0.3, max_delay_s=5.0, world=world)
    async with running(loop.run()):
        source.queue.put_nowait(fleet("a", "b"))
        await world.advance()
        assert len(target.calls) == 1  # the first list, at once
        assert members(target.router) == {"a": "127.0.1.1:8000", "b": "127.0.1.2:8000"}
        # A repeat is no change; a flap undone within the debounce is no change either.
        source.queue.put_nowait(fleet("b", "a")[::-1])
        source.queue.put_nowait(fleet("a"))
        await world.advance(0.29)
        source.queue.put_nowait(fleet("a", "b"))
        await world.advance(0.5)
        assert len(target.calls) == 1
        # A real change lands after the debounce, not before.
        source.queue.put_nowait(fleet("a", "b", "c"))
        await world.advance(0.29)
        assert "c" not in members(target.router)
        await world.advance(0.02)
        assert "c" in members(target.router)
        assert target.calls[-1] == ["a", "b", "c"] and len(target.calls) == 2


async def test_loop_max_delay_bounds_a_flapping_fleet() -> None:
    source, target, world = ScriptedSource(), RecordingRouter(), ManualWorld()
    loop = DiscoveryLoop(source, target, debounce_s=0.2, max_delay_s=0.4, world=world)
    async with running(loop.run()):
        source.queue.put_nowait(fleet("a"))
        await world.advance()
        assert len(target.calls) == 1
        # d flaps every 0.1 s, never quiet for the debounce, while b has joined for good.
        for i in range(3):
            source.queue.put_nowait(fleet("a", "b", "d") if i % 2 else fleet("a", "b"))
            await world.advance(0.1)
        assert "b" not in members(target.router)  # 0.3 s of flapping: not yet
        source.queue.put_nowait(fleet("a", "b", "d"))
        await world.advance(0.1)
        assert "b" in members(target.router)  # applied by the 0.4 s bound despite the flapping


async def test_loop_keeps_static_replicas_and_survives_a_failing_source() -> None:
    source, target = ScriptedSource(), RecordingRouter()
    static = [Replica("outside", "127.0.2.1:8000")]
    metrics = RouterMetrics()
    world = ManualWorld()
    loop = DiscoveryLoop(source, target, debounce_s=0.0, static=static, retry_s=0.05, metrics=metrics, world=world)
    async with running(loop.run()) as task:
        source.queue.put_nowait(fleet("a"))
        await world.advance()
        assert set(members(target.router)) == {"a", "outside"}
        source.queue.put_nowait(RuntimeError("the source broke"))
        await world.advance(0.04)
        assert source.starts == 1  # restarted only after retry_s
        await world.advance(0.01)
        assert source.starts == 2
        assert set(members(target.router)) == {"a", "outside"}  # kept while the source was down
        source.queue.put_nowait(fleet("b"))
        await world.advance()
        assert set(members(target.router)) == {"b", "outside"}
        source.queue.put_nowait(None)  # a source that ends ends the loop
        await asyncio.wait_for(task, 2.0)
    value = metrics.registry.get_sample_value
    assert value("extproc_discovery_lists_total") == 2
    assert value("extproc_discovery_changes_applied_total") == 2
    assert value("extproc_discovery_failures_total") == 1
    assert value("extproc_discovery_members") == 2


async def test_static_source_yields_the_config_once() -> None:
    source = StaticDiscovery(fleet("a", "b"))
    assert [[r.name for r in lst] async for lst in source.updates()] == [["a", "b"]]
    await run_discovery(make_config().discovery, RecordingRouter())  # static: returns at once


# --- DNS --------------------------------------------------------------------------------------------


class FakeResolver:
    """Answers from tables the test edits; an unknown name or ``failing`` is a ResolutionError."""

    def __init__(self) -> None:
        self.a: dict[str, list[str]] = {}
        self.aaaa: dict[str, list[str]] = {}
        self.srv: dict[str, list[SrvRecord]] = {}
        self.failing = False
        self.queries = 0

    async def addresses(self, host: str, record: str) -> list[str]:
        self.queries += 1
        table = self.a if record == "A" else self.aaaa
        if self.failing or host not in table:
            raise ResolutionError(f"{host} {record}: NXDOMAIN")
        return list(table[host])

    async def services(self, name: str) -> list[SrvRecord]:
        self.queries += 1
        if self.failing or name not in self.srv:
            raise ResolutionError(f"{name} SRV: NXDOMAIN")
        return list(self.srv[name])


HEADLESS = "vllm.llm.svc.cluster.local"


async def test_dns_a_records_join_and_leave_through_the_router() -> None:
    resolver = FakeResolver()
    resolver.a[HEADLESS] = ["127.0.1.2", "127.0.1.1"]
    world = ManualWorld()
    source = DnsDiscovery(HEADLESS, 8000, "A", interval_s=0.02, resolver=resolver, world=world)
    target = RecordingRouter()
    async with running(DiscoveryLoop(source, target, debounce_s=0.0, world=world).run()):
        await world.advance()
        assert members(target.router) == {"127.0.1.1:8000": "127.0.1.1:8000", "127.0.1.2:8000": "127.0.1.2:8000"}
        resolver.a[HEADLESS] = ["127.0.1.2", "127.0.1.3"]
        await world.advance(0.02)  # the next resolution
        assert set(members(target.router)) == {"127.0.1.2:8000", "127.0.1.3:8000"}
        # Outages, NXDOMAIN and empty answers keep the last list.
        resolver.failing = True
        queries = resolver.queries
        await world.advance(0.1)
        assert resolver.queries > queries + 3  # resolutions during the outage, every 20 ms
        resolver.failing = False
        resolver.a[HEADLESS] = []
        await world.advance(0.1)
        assert set(members(target.router)) == {"127.0.1.2:8000", "127.0.1.3:8000"}
        assert all(call for call in target.calls)  # never an empty membership
        assert len(target.calls) == 2  # re-resolutions of the same answer change nothing


async def test_dns_srv_records_and_aaaa() -> None:
    resolver = FakeResolver()
    name = f"_http._tcp.{HEADLESS}"
    resolver.srv[name] = [SrvRecord("vllm-0.vllm.llm.svc", 8000), SrvRecord("vllm-1.vllm.llm.svc", 8001)]
    resolver.a["vllm-0.vllm.llm.svc"] = ["127.0.1.1"]
    resolver.aaaa["vllm-1.vllm.llm.svc"] = ["fd00::2"]  # no A record: AAAA is used
    source = DnsDiscovery(name, record="SRV", resolver=resolver)
    replicas = await source.resolve()
    assert [(r.name, r.address) for r in replicas] == [
        ("vllm-0.vllm.llm.svc", "127.0.1.1:8000"),
        ("vllm-1.vllm.llm.svc", "[fd00::2]:8001"),
    ]
    # One target serving two ports is two replicas, told apart by address.
    resolver.srv[name].append(SrvRecord("vllm-0.vllm.llm.svc", 9000))
    names = [r.name for r in await source.resolve()]
    assert names == ["vllm-0.vllm.llm.svc/127.0.1.1:8000", "vllm-0.vllm.llm.svc/127.0.1.1:9000", "vllm-1.vllm.llm.svc"]
    # A target that does not resolve fails the whole answer (no partial leave).
    resolver.srv[name].append(SrvRecord("vllm-2.vllm.llm.svc", 8000))
    with pytest.raises(ResolutionError):
        await source.resolve()
    resolver.aaaa[HEADLESS] = ["fd00::1"]
    assert [r.address for r in await DnsDiscovery(HEADLESS, 80, "AAAA", resolver=resolver).resolve()] == [
        "[fd00::1]:80"
    ]


async def test_dns_source_yields_nothing_until_the_first_good_answer() -> None:
    resolver = FakeResolver()
    world = ManualWorld()
    source = DnsDiscovery(HEADLESS, 8000, interval_s=0.01, resolver=resolver, world=world)
    updates = source.updates()
    first = asyncio.ensure_future(anext(updates))
    await world.advance(0.05)
    assert not first.done() and resolver.queries >= 5  # failing: quiet, not an empty list
    resolver.a[HEADLESS] = ["127.0.1.1"]
    await world.advance(0.01)
    assert [r.name for r in await asyncio.wait_for(first, 2.0)] == ["127.0.1.1:8000"]
    await updates.aclose()


# --- EndpointSlices, pure ---------------------------------------------------------------------------


def endpoint(pod: str, ip: str, ready: bool | None = True, terminating: bool = False, **extra: Any) -> dict[str, Any]:
    conditions: dict[str, Any] = {"serving": bool(ready) or terminating, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [ip],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE},
        "nodeName": "node-1",
        "zone": "zone-a",
        **extra,
    }


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    ports: Sequence[tuple[str, int]] = (("http", 8000),),
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": address_type,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
        "endpoints": endpoints,
    }


def test_only_ready_endpoints_are_replicas() -> None:
    obj = endpoint_slice(
        "s",
        [
            endpoint("ready", "127.0.1.1"),
            endpoint("unknown", "127.0.1.2", ready=None),  # no condition: taken as ready
            endpoint("starting", "127.0.1.3", ready=False),
            endpoint("draining", "127.0.1.4", ready=False, terminating=True),  # still serving: leaves anyway
            {"addresses": [], "conditions": {"ready": True}},
        ],
    )
    replicas = replicas_of_slice(obj, PortChoice())
    assert [(r.name, r.address) for r in replicas] == [("ready", "127.0.1.1:8000"), ("unknown", "127.0.1.2:8000")]
    assert replicas[0].labels == {"zone": "zone-a", "node": "node-1"}


def test_slice_ports_address_types_and_names() -> None:
    two_ports = endpoint_slice("s", [endpoint("p", "127.0.1.1")], ports=[("http", 8000), ("metrics", 9000)])
    assert replicas_of_slice(two_ports, PortChoice(port_name="http"))[0].address == "127.0.1.1:8000"
    assert replicas_of_slice(two_ports, PortChoice(port_name="grpc")) == ()
    assert replicas_of_slice(two_ports, PortChoice()) == ()  # which one? none rather than a guess
    assert replicas_of_slice(two_ports, PortChoice(port=7000))[0].address == "127.0.1.1:7000"
    v6 = endpoint_slice("s6", [endpoint("p", "fd00::1")], address_type="IPv6")
    assert replicas_of_slice(v6, PortChoice()) == ()  # dual stack: the other family's slice
    assert replicas_of_slice(v6, PortChoice(address_type="IPv6"))[0].address == "[fd00::1]:8000"
    bare = endpoint_slice("b", [{"addresses": ["127.0.1.5"], "hostname": "h5"}, {"addresses": ["127.0.1.6"]}])
    assert [r.name for r in replicas_of_slice(bare, PortChoice())] == ["h5", "127.0.1.6:8000"]


def test_slice_set_merges_slices_and_deduplicates_a_moving_endpoint() -> None:
    slices = SliceSet(PortChoice())
    slices.reset(
        [endpoint_slice("s1", [endpoint("p0", "127.0.1.1")]), endpoint_slice("s2", [endpoint("p1", "127.0.1.2")])]
    )
    slices.put(endpoint_slice("s3", [endpoint("p1", "127.0.1.2")]))  # p1 moving from s2 to s3
    assert [r.name for r in slices.replicas()] == ["p0", "p1"]
    slices.remove({"metadata": {"name": "s2"}})
    slices.remove({"metadata": {"name": "s3"}})
    assert [r.name for r in slices.replicas()] == ["p0"]


def test_backoff_doubles_with_jitter_up_to_a_cap() -> None:
    class Half:
        def random(self) -> float:
            return 1.0

    backoff = Backoff(0.5, 4.0, Half())  # type: ignore[arg-type]
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next() == 0.5


# --- Kubernetes against a fake API server -----------------------------------------------------------


class FakeApiServer:
    """Just enough of an API server for EndpointSlices: a list with a resourceVersion, and watches
    that replay history past a version and then stream changes as newline-delimited JSON."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted = 0  # watches from an older version are told 410 Gone
        self.gone_as_status = False  # answer them with HTTP 410 rather than an ERROR event
        self.fail_next = 0  # answer this many requests with HTTP 500
        self.lists = 0
        self.watch_versions: list[str] = []
        self.selectors: set[str] = set()
        self._watchers: set[asyncio.Queue[tuple[str, dict[str, Any]] | None]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, obj))
        for queue in self._watchers:
            queue.put_nowait((kind, obj))

    def put(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.slices[name] = obj
        self._emit(kind, obj)

    def delete(self, name: str) -> None:
        self._emit("DELETED", self.slices.pop(name))

    def bookmark(self) -> str:
        self.version += 1
        for queue in self._watchers:
            queue.put_nowait(
                ("BOOKMARK", {"kind": "EndpointSlice", "metadata": {"resourceVersion": str(self.version)}})
            )
        return str(self.version)

    def expire(self, silent_change: dict[str, Any] | None = None) -> None:
        """Compact history past every version handed out, changing a slice without an event (only a
        new list can show it), and tell open watches 410 Gone."""
        if silent_change is not None:
            self.slices[silent_change["metadata"]["name"]] = silent_change
        self.version += 1
        self.compacted = self.version
        gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410, "message": "too old"}
        for queue in self._watchers:
            queue.put_nowait(("ERROR", gone))

    def close_watches(self) -> None:
        for queue in self._watchers:
            queue.put_nowait(None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert request.match_info["namespace"] == NAMESPACE
        self.selectors.add(request.query.get("labelSelector", ""))
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd is sad"}, status=500)
        if request.query.get("watch") != "true":
            self.lists += 1
            items = [
                dict(obj, metadata=dict(obj["metadata"], resourceVersion=str(self.version)))
                for obj in self.slices.values()
            ]
            body = {"kind": "EndpointSliceList", "metadata": {"resourceVersion": str(self.version)}, "items": items}
            return web.json_response(body)
        since = request.query.get("resourceVersion", "")
        self.watch_versions.append(since)
        if int(since or 0) < self.compacted and self.gone_as_status:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"}, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if int(since or 0) < self.compacted:
            await send("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})
            return response
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            for version, kind, obj in self.history:
                if version > int(since or 0):
                    await send(kind, obj)
            timeout = float(request.query.get("timeoutSeconds", "60"))
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    break
                if item is None:
                    break
                await send(*item)
                if item[0] == "ERROR":  # as the API server does: an error ends the watch
                    break
        except ConnectionResetError:
            pass
        finally:
            self._watchers.discard(queue)
        return response


@pytest.fixture
async def api_server() -> AsyncIterator[FakeApiServer]:
    server = await FakeApiServer().start()
    try:
        yield server
    finally:
        await server.stop()


def kubernetes_source(server: FakeApiServer, **kwargs: Any) -> KubernetesDiscovery:
    from kubernetes.aio import client

    return KubernetesDiscovery(
        SERVICE,
        namespace=NAMESPACE,
        port_name="http",
        configuration=client.Configuration(host=server.url),
        backoff_initial_s=0.02,
        backoff_max_s=0.1,
        **kwargs,
    )


async def test_kubernetes_list_watch_ready_terminating_deleted_gone_and_reconnect(api_server: FakeApiServer) -> None:
    api = api_server
    target = RecordingRouter()
    router = target.router
    api.put(
        endpoint_slice(
            "vllm-abc",
            [endpoint("vllm-0", "127.0.1.1"), endpoint("vllm-1", "127.0.1.2"), endpoint("vllm-2", "127.0.1.3", False)],
        )
    )

    def names() -> set[str]:
        return set(members(router))

    async with running(DiscoveryLoop(kubernetes_source(api), target, debounce_s=0.0).run()):
        # 1. The initial list.
        await wait_for(lambda: names() == {"vllm-0", "vllm-1"}, "the listed ready endpoints")
        assert members(router)["vllm-0"] == "127.0.1.1:8000"
        assert api.selectors == {"kubernetes.io/service-name=vllm"}
        await wait_for(lambda: api.watchers == 1, "the watch")
        assert api.watch_versions == [str(api.version)]
        # 2. An endpoint becomes ready.
        slice_a = [endpoint("vllm-0", "127.0.1.1"), endpoint("vllm-1", "127.0.1.2"), endpoint("vllm-2", "127.0.1.3")]
        api.put(endpoint_slice("vllm-abc", slice_a))
        await wait_for(lambda: names() == {"vllm-0", "vllm-1", "vllm-2"}, "vllm-2 to join")
        # 3. A second slice of the same service.
        api.put(endpoint_slice("vllm-def", [endpoint("vllm-3", "127.0.1.4")]))
        await wait_for(lambda: "vllm-3" in names(), "the second slice")
        # 4. One terminates: it still serves its requests, but leaves the membership.
        slice_a[1] = endpoint("vllm-1", "127.0.1.2", ready=False, terminating=True)
        api.put(endpoint_slice("vllm-abc", slice_a))
        await wait_for(lambda: names() == {"vllm-0", "vllm-2", "vllm-3"}, "vllm-1 to leave")
        # 5. A slice is deleted.
        api.delete("vllm-def")
        await wait_for(lambda: names() == {"vllm-0", "vllm-2"}, "the deleted slice's endpoints to leave")
        assert api.lists == 1
        # 6. 410 Gone: only a new list shows the change made meanwhile.
        api.expire(silent_change=endpoint_slice("vllm-abc", [*slice_a, endpoint("vllm-4", "127.0.1.5")]))
        await wait_for(lambda: names() == {"vllm-0", "vllm-2", "vllm-4"}, "the re-list after 410")
        assert api.lists == 2
        # 7. A bookmark moves the version on; the server closes the watch; the client resumes
        #    from the bookmark's version, without listing again.
        await wait_for(lambda: api.watchers == 1, "the watch after the re-list")
        bookmark = api.bookmark()
        await asyncio.sleep(0.05)  # real time: the bookmark over the watch's HTTP stream
        watches = len(api.watch_versions)
        api.close_watches()
        await wait_for(lambda: len(api.watch_versions) == watches + 1 and api.watchers == 1, "the reconnect")
        assert api.watch_versions[-1] == bookmark and api.lists == 2
        api.put(endpoint_slice("vllm-abc", [endpoint("vllm-2", "127.0.1.3"), endpoint("vllm-4", "127.0.1.5")]))
        await wait_for(lambda: names() == {"vllm-2", "vllm-4"}, "a change after the reconnect")
    assert all(target.calls)  # the membership was never emptied on the way
    assert api.lists == 2


async def test_kubernetes_backs_off_on_errors_and_keeps_the_last_list(api_server: FakeApiServer) -> None:
    api = api_server
    api.put(endpoint_slice("vllm-abc", [endpoint("vllm-0", "127.0.1.1")]))
    api.fail_next = 2  # the first two lists fail
    target = RecordingRouter()
    async with running(DiscoveryLoop(kubernetes_source(api), target, debounce_s=0.0).run()):
        await wait_for(lambda: set(members(target.router)) == {"vllm-0"}, "the list after two failures")
        assert api.lists == 1  # the failed ones are not counted: they were answered 500
        await wait_for(lambda: api.watchers == 1, "the watch")
        # The watch is cut and the API server answers errors for a while: nothing leaves.
        api.fail_next = 3
        api.close_watches()
        await wait_for(lambda: api.fail_next == 0 and api.watchers == 1, "recovery")
        assert set(members(target.router)) == {"vllm-0"} and target.calls == [["vllm-0"]]
        # A watch that comes back with HTTP 410 (rather than an ERROR event) forces a list too.
        api.gone_as_status = True
        api.expire()
        await wait_for(lambda: api.lists == 2, "the re-list after HTTP 410")
        api.put(endpoint_slice("vllm-abc", [endpoint("vllm-0", "127.0.1.1"), endpoint("vllm-1", "127.0.1.2")]))
        await wait_for(lambda: set(members(target.router)) == {"vllm-0", "vllm-1"}, "vllm-1 to join")


async def test_serve_wiring_kubeconfig_and_config(
    api_server: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The path ``extproc serve`` takes: YAML config -> run_discovery -> a kubeconfig -> the API."""
    api_server.put(endpoint_slice("vllm-abc", [endpoint("vllm-0", "127.0.1.1")], ports=[("http", 8000), ("m", 9)]))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters: [{{name: fake, cluster: {{server: '{api_server.url}'}}}}]\n"
        "users: [{name: nobody, user: {}}]\n"
        "contexts: [{name: test, context: {cluster: fake, user: nobody}}]\n"
    )
    section = {
        "type": "kubernetes",
        "namespace": NAMESPACE,
        "service": SERVICE,
        "port_name": "http",
        "kubeconfig": str(kubeconfig),
        "debounce_s": 0,
    }
    cfg = config_from_mapping({"mode": "cluster", "discovery": section})
    target = RecordingRouter()
    with caplog.at_level(logging.WARNING, logger="extproc.fleet.discovery"):
        async with running(run_discovery(cfg.discovery, target, static=cfg.replicas, cluster_mode=True)):
            await wait_for(lambda: members(target.router) == {"vllm-0": "127.0.1.1:8000"}, "vllm-0")
    assert "cluster mode" in caplog.text


def test_serve_needs_replicas_only_without_discovery(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from extproc.adapters import cli
    from extproc.adapters.server import serving

    with pytest.raises(SystemExit):
        cli.main(["serve", "--metrics-listen", "off"])
    served: list[object] = []

    async def fake_serve(cfg: object) -> None:
        served.append(cfg)

    monkeypatch.setattr(serving, "serve", fake_serve)
    path = tmp_path / "router.yaml"
    path.write_text("discovery: {type: dns, name: vllm.llm.svc, port: 8000}\n")
    assert cli.main(["serve", "--config", str(path)]) == 0 and len(served) == 1


class FakeNameserver(asyncio.DatagramProtocol):
    """A UDP nameserver on 127.0.0.1 answering from a zone table (dnspython builds the messages)."""

    def __init__(self, zone: dict[tuple[str, str], list[str]]) -> None:
        self.zone = zone
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        import dns.message
        import dns.rcode
        import dns.rdatatype
        import dns.rrset

        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        key = (question.name.to_text(), dns.rdatatype.to_text(question.rdtype))
        if key in self.zone:
            response.answer.append(dns.rrset.from_text_list(question.name, 30, "IN", key[1], self.zone[key]))
        elif not any(name == key[0] for name, _ in self.zone):
            response.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(response.to_wire(), addr)


async def test_the_dnspython_resolver_against_a_local_nameserver() -> None:
    zone = {
        ("_http._tcp.vllm.llm.svc.", "SRV"): ["0 50 8000 vllm-0.vllm.llm.svc.", "0 50 8000 vllm-1.vllm.llm.svc."],
        ("vllm-0.vllm.llm.svc.", "A"): ["127.0.1.1"],
        ("vllm-1.vllm.llm.svc.", "A"): ["127.0.1.2"],
        ("vllm.llm.svc.", "A"): ["127.0.1.1", "127.0.1.2"],
    }
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: FakeNameserver(zone), local_addr=("127.0.0.1", 0))
    try:
        port = transport.get_extra_info("sockname")[1]
        resolver = DnsPythonResolver(timeout_s=2.0, nameservers=["127.0.0.1"], port=port)
        srv = await DnsDiscovery("_http._tcp.vllm.llm.svc.", record="SRV", resolver=resolver).resolve()
        assert [(r.name, r.address) for r in srv] == [
            ("vllm-0.vllm.llm.svc", "127.0.1.1:8000"),
            ("vllm-1.vllm.llm.svc", "127.0.1.2:8000"),
        ]
        a = await DnsDiscovery("vllm.llm.svc.", 8000, resolver=resolver).resolve()
        assert [r.address for r in a] == ["127.0.1.1:8000", "127.0.1.2:8000"]
        with pytest.raises(ResolutionError, match="NXDOMAIN"):
            await resolver.addresses("gone.llm.svc.", "A")
        with pytest.raises(ResolutionError):  # the name exists, the record type does not
            await resolver.addresses("vllm.llm.svc.", "AAAA")
    finally:
        transport.close()


@pytest.fixture(autouse=True)
def _no_real_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test may ask the machine's nameserver: the default resolver only talks to one a test
    started on 127.0.0.1."""
    from extproc.fleet.discovery.dns import DnsPythonResolver

    original = DnsPythonResolver._resolve

    async def local_only(self: DnsPythonResolver, name: str, rdtype: str) -> list[Any]:
        assert self.nameservers == ["127.0.0.1"], "a test asked the machine's nameserver"
        return await original(self, name, rdtype)

    monkeypatch.setattr(DnsPythonResolver, "_resolve", local_only)
    yield
