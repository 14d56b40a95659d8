"""The router as an InferencePool's endpoint picker, through real Envoy configured as the gateways
that implement InferencePool configure it: TLS to the picker (its self-signed certificate, not
verified), FULL_DUPLEX_STREAMED bodies, the subset hint forwarded from ``envoy.lb.subset_hint``,
the destination read from ``envoy.lb`` metadata or the header (override_host), FailClose and
FailOpen. The pool and its pod are served by a fake Kubernetes API server in the test.

On loopback every endpoint is 127.0.0.1, so the pool's one pod serves three target ports (three
data-parallel ranks, three replicas); an endpoint leaves the pool when the pool's targetPorts drop
its port, and all of them when the pod stops matching the selector.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.envoy_config import GatewaySpec, ProcessorTls, render
from extproc.routing.model import Replica
from extproc_lab.demo.processes import ProcessGroup, envoy_binary, free_port, wait_for_http, wait_for_port
from tests.conftest import require_binary
from tests.fake_kube import FakeKube, pod, pool
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
NS = "llm"
SELECTOR = {"app": "vllm"}
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
GIE_CHART_ARGS = (
    *("--pool-name", "vllm", "--pool-namespace", NS, "--pool-group", "inference.networking.k8s.io"),
    *("--zap-encoder", "json", "--config-file", "/config/default-plugins.yaml", "--tracing=false"),
)


@dataclass
class Picker:
    """The fake replicas, the picker (``extproc serve`` following the pool) and Envoy, as processes."""

    dir: Path
    kube: FakeKube
    ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    picker_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    dead_port: int = field(default_factory=free_port)  # nothing listens: a picker that is down
    listeners: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.procs = ProcessGroup(self.dir)

    def rank(self, i: int) -> str:
        return f"{HOST}:{self.ports[i]}"

    async def start(self) -> None:
        for i, port in enumerate(self.ports):
            argv = [sys.executable, "-m", "extproc", "replica", "--name", f"rank-{i}", "--port", str(port)]
            self.procs.start(f"rank-{i}", [*argv, "--time-scale", "0.02"])
        for port in self.ports:
            await asyncio.to_thread(wait_for_http, f"http://{HOST}:{port}/health")
        kubeconfig = self.dir / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.kube.url}}],
                    "users": [{"name": "nobody", "user": {}}],
                    "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "nobody"}}],
                    "current-context": "test",
                }
            )
        )
        config = self.dir / "router.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "mode": "endpoint",
                    "discovery": {"type": "inference_pool", "name": "vllm", "kubeconfig": str(kubeconfig)},
                    "grpc": {"health_listen": f"{HOST}:{self.health_port}"},
                    "metrics": {"listen": f"{HOST}:{self.metrics_port}"},
                }
            )
        )
        # Started as GIE's inferencepool chart starts its picker (its flags, no command; TLS on by
        # default), the test's addresses on loopback after them (a key's own flag wins).
        argv = [sys.executable, "-m", "extproc", *GIE_CHART_ARGS, "--config", str(config)]
        loopback = ["--listen", f"{HOST}:{self.picker_port}", "--grpc-health-listen", f"{HOST}:{self.health_port}"]
        picker = self.procs.start("picker", [*argv, *loopback, "--metrics-listen", f"{HOST}:{self.metrics_port}"])
        await asyncio.to_thread(wait_for_port, HOST, self.picker_port, 15.0, picker)
        self._start_envoy()

    def _start_envoy(self) -> None:
        spec = GatewaySpec(
            replicas=[Replica(f"rank-{i}", self.rank(i)) for i in range(3)],
            processor=f"{HOST}:{self.picker_port}",
            mode="endpoint",
            listen=f"{HOST}:{free_port()}",
            admin=f"{HOST}:{free_port()}",
            full_duplex=True,
            message_timeout_ms=5000,
            processor_tls=ProcessorTls(ca_file="unused", server_name="localhost"),
        )
        bootstrap = render(spec)
        resources = bootstrap["static_resources"]
        clusters = {c["name"]: c for c in resources["clusters"]}
        tls = clusters["extproc"]["transport_socket"]["typed_config"]["common_tls_context"]
        del tls["validation_context"]  # as the gateways: TLS, the picker's certificate not verified
        dead = copy.deepcopy(clusters["extproc"])
        dead["name"] = "picker_down"
        dead["load_assignment"] = {"cluster_name": "picker_down", "endpoints": [_endpoint(self.dead_port)]}
        plain = copy.deepcopy(clusters["extproc"])
        plain["name"] = "picker_plaintext"
        del plain["transport_socket"]  # a gateway that forgot TLS
        plain["load_assignment"] = {"cluster_name": "picker_plaintext", "endpoints": [_endpoint(self.picker_port)]}
        resources["clusters"] += [dead, plain]
        template = resources["listeners"][0]
        variants: dict[str, dict[str, Any]] = {
            "open": {},
            "hinted": {"subset": [self.rank(1), self.rank(2)]},
            "empty": {"subset": []},
            "fail_close_down": {"cluster": "picker_down"},
            "fail_open_down": {"cluster": "picker_down", "fail_open": True},
            "fail_open_down_buffered": {"cluster": "picker_down", "fail_open": True, "buffered": True},
            "plaintext": {"cluster": "picker_plaintext"},
        }
        resources["listeners"] = []
        for name, variant in variants.items():
            self.listeners[name] = free_port()
            resources["listeners"].append(_listener(template, name, self.listeners[name], **variant))
        path = self.dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        argv = [envoy_binary(), "-c", str(path), "--log-level", "warn", "--concurrency", "1", "--disable-hot-restart"]
        envoy = self.procs.start("envoy", argv)
        for port in self.listeners.values():
            wait_for_port(HOST, port, proc=envoy)

    def url(self, listener: str) -> str:
        return f"http://{HOST}:{self.listeners[listener]}/v1/chat/completions"


def _endpoint(port: int) -> dict[str, Any]:
    return {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": port}}}}]}


def _listener(
    template: dict[str, Any],
    name: str,
    port: int,
    subset: list[str] | None = None,
    cluster: str = "extproc",
    fail_open: bool = False,
    buffered: bool = False,
) -> dict[str, Any]:
    """A copy of the rendered listener: ext_proc forwarding the subset hint's namespace, fail closed
    (the API's default) unless ``fail_open``, calling ``cluster``; with ``subset``, a filter before
    it that puts the hint in the request's metadata, as the gateway's own code does."""
    listener = copy.deepcopy(template)
    listener["name"] = name
    listener["address"]["socket_address"]["port_value"] = port
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    ext_proc["failure_mode_allow"] = fail_open
    ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] = cluster
    ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": [SUBSET_NS]}}
    if buffered:  # as Envoy AI Gateway with its processing-body-mode annotation
        ext_proc["processing_mode"].update(request_body_mode="BUFFERED", request_trailer_mode="SKIP")
    if subset is not None:
        hint = {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_NS, "value": {SUBSET_KEY: subset}}],
            },
        }
        filters.insert(filters.index(next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")), hint)
    return listener


@pytest.fixture
async def picker(tmp_path: Path) -> AsyncIterator[Picker]:
    require_binary("envoy")
    kube = await FakeKube().start()
    setup = Picker(tmp_path, kube)
    kube.put("pools", pool("vllm", NS, SELECTOR, tuple(setup.ports)))
    kube.put("pods", pod("pod-a", NS, HOST, SELECTOR))
    kube.put("pods", pod("pod-x", NS, HOST, {"app": "other"}))  # not in the pool
    try:
        await setup.start()
        yield setup
    finally:
        setup.procs.stop_all()
        await kube.stop()


async def send(http: aiohttp.ClientSession, url: str, session: str, text: str = "hello") -> tuple[int, str, str]:
    """One chat request: (status, the replica that answered, the body)."""
    body = {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with http.post(url, json=body, headers={"x-session-id": session}) as r:
        return r.status, r.headers.get("x-replica-name", ""), await r.text()


async def members(http: aiohttp.ClientSession, picker: Picker) -> float:
    async with http.get(f"http://{HOST}:{picker.metrics_port}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("extproc_discovery_members "):
                return float(line.split()[1])
    return -1.0


async def test_a_gateway_routes_through_the_picker_over_tls_on_pool_members_and_subsets(picker: Picker) -> None:
    async with aiohttp.ClientSession() as http:
        await wait_for(lambda: _equals(members(http, picker), 3), "the pool's three ranks", within_s=20)
        # Routed by the picker (sessions stick) over TLS, in FULL_DUPLEX_STREAMED, on pool members.
        seen: dict[str, str] = {}
        for s in range(12):
            for turn in range(2):
                status, replica, body = await send(http, picker.url("open"), f"s{s}", f"conversation {s} turn {turn}")
                assert status == 200, body
                assert seen.setdefault(f"s{s}", replica) == replica
        assert set(seen.values()) <= {"rank-0", "rank-1", "rank-2"} and len(set(seen.values())) >= 2
        log = (picker.dir / "picker.log").read_text()
        assert '"level": "info"' in log and "TLS, self-signed" in log  # --zap-encoder json: JSON lines
        # The names GIE's chart probes its picker by answer on the plaintext health port.
        async with grpc.aio.insecure_channel(f"{HOST}:{picker.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("inference-extension", "readiness", "liveness"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        # The subset hint excludes rank-0: a session whose replica is rank-0 goes elsewhere, fallbacks too.
        home = next(s for s, r in seen.items() if r == "rank-0")
        for turn in range(6):
            status, replica, body = await send(http, picker.url("hinted"), home, f"hinted turn {turn}")
            assert status == 200 and replica in {"rank-1", "rank-2"}, (status, replica, body)
        # A hint that offers nothing: 503 from the picker, not a pick of its own.
        status, _, body = await send(http, picker.url("empty"), home)
        assert status == 503 and "subset hint" in body
        # An endpoint leaves the pool (its port dropped from targetPorts): never picked after the event.
        picker.kube.put("pools", pool("vllm", NS, SELECTOR, tuple(picker.ports[:2])))
        left = time.monotonic()
        await wait_for(lambda: _equals(members(http, picker), 2), "the pool's two ranks", within_s=10)
        took = time.monotonic() - left
        for s in range(20):
            status, replica, body = await send(http, picker.url("open"), f"after-{s}", f"after {s}")
            assert status == 200 and replica in {"rank-0", "rank-1"}, (status, replica, body)
        assert took < 5.0, took
        # The pod stops matching the pool's selector: no member, and the picker answers 503.
        picker.kube.put("pods", pod("pod-a", NS, HOST, {"app": "retired"}))
        await wait_for(lambda: _equals(members(http, picker), 0), "an empty pool", within_s=10)
        status, _, body = await send(http, picker.url("open"), "empty-pool")
        assert status == 503 and "no ready endpoint" in body


async def test_fail_close_fail_open_and_a_tls_mismatch(picker: Picker) -> None:
    async with aiohttp.ClientSession() as http:
        await wait_for(lambda: _equals(members(http, picker), 3), "the pool's three ranks", within_s=20)
        # The picker down: FailClose fails the request; FailOpen lets Envoy pick among the endpoints
        # with a buffered body...
        status, _, _ = await send(http, picker.url("fail_close_down"), "down")
        assert status >= 500
        status, replica, _ = await send(http, picker.url("fail_open_down_buffered"), "down")
        assert status == 200 and replica in {"rank-0", "rank-1", "rank-2"}
        # ... but not with FULL_DUPLEX_STREAMED: Envoy 1.40 fails the request although
        # failure_mode_allow is set (seen here; docs/helm.md warns). Kept as a test so that an Envoy
        # that fails open in this mode too is noticed.
        status, _, _ = await send(http, picker.url("fail_open_down"), "down")
        assert status == 500
        # A gateway speaking plaintext to the TLS picker: refused, and told within seconds, on the
        # picker's side too: a counter of failed handshakes and a log line naming the likely cause.
        started = time.monotonic()
        status, _, _ = await send(http, picker.url("plaintext"), "plain")
        assert status >= 500 and time.monotonic() - started < 5.0
        await wait_for(lambda: _positive(handshake_failures(http, picker)), "the failed handshakes counted", within_s=5)
        log = (picker.dir / "picker.log").read_text()
        assert "TLS handshake failed on a TLS port of this router (WRONG_VERSION_NUMBER)" in log
        assert "most likely a client speaking plaintext to this TLS port" in log
        assert time.monotonic() - started < 10.0


async def handshake_failures(http: aiohttp.ClientSession, picker: Picker) -> float:
    async with http.get(f"http://{HOST}:{picker.metrics_port}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith('extproc_tls_handshake_failures_total{reason="WRONG_VERSION_NUMBER"}'):
                return float(line.split()[1])
    return 0.0


async def _positive(value: Any) -> bool:
    return bool(await value > 0)


async def _equals(value: Any, expected: float) -> bool:
    return bool(await value == expected)
