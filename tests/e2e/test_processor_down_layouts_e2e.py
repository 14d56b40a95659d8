"""With the processor STOPPED, a client's routing headers route nothing, in every deployment layout
the project ships, through real Envoy and fake replicas: each ``envoy/`` scenario's shipped config,
the Istio ``EnvoyFilter`` applied to a stand-in of Istio's gateway, and the GIE overlay's
inference gateway (its strip for Istio failing open; any other implementation failing closed).

Each request carries every header docs/security.md's table says a client may not set
(:func:`tests.helpers.trusted_headers`): the cluster and endpoint headers name one replica,
``x-prefiller-host-port`` and the rest a listener no config knows. Checked: the answers are spread
(nobody pinned them where the client named), no replica received any of those headers (a decode
pod's sidecar would make its prefill hop there), and the listener was never connected to."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.scenario import ScenarioGateway
from tests.conftest import ROOT, require_binary
from tests.helpers import apply_istio_patches, trusted_headers

pytestmark = pytest.mark.e2e
REQUESTS = 12
SCENARIOS = {  # as each envoy/<scenario>/verify.py starts it
    "cluster-mode": {"mode": "cluster"},
    "endpoint-mode": {"mode": "endpoint"},
    "endpoint-original-dst": {"mode": "endpoint", "extra_replicas": 1},
    "failover": {"mode": "cluster"},
    "unix-socket": {"mode": "cluster", "unix_socket": True},
}
ROUTER_FILTER = "envoy.filters.http.router"
STRIP_FILTER = "envoy.filters.http.header_mutation"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"


def test_every_shipped_scenario_with_a_processor_is_covered() -> None:
    shipped = {p.parent.name for p in (ROOT / "envoy").glob("*/envoy.yaml") if "ext_proc" in p.read_text()}
    assert shipped == set(SCENARIOS)


@contextmanager
def trap() -> Iterator[tuple[str, list[int]]]:
    """A loopback listener no config names: (its address, a list that grows per connection)."""
    got: list[int] = []
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            got.append(1)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", got
    finally:
        done.set()
        thread.join(2)
        sock.close()


async def attack(gw: LocalGateway, trap_address: str) -> tuple[list[int], list[str], list[dict[str, str]]]:
    """The processor stopped, :data:`REQUESTS` requests with every trusted header set: their
    statuses, the replicas that answered, and the headers the replicas received."""
    names = trusted_headers()
    assert {"x-prefiller-host-port", "x-target-cluster", "x-gateway-destination-endpoint"} <= names
    named = gw.members[0]
    spoofed = {name: trap_address for name in names} | {
        "x-target-cluster": named.name,
        "x-gateway-destination-endpoint": named.address,
        "x-tenant-id": "acme",
    }
    gw.procs.kill(gw.processor_name())
    statuses: list[int] = []
    answered: list[str] = []
    async with aiohttp.ClientSession() as http:
        for i in range(REQUESTS):
            body = {"model": "demo-model", "messages": [{"role": "user", "content": f"down {i}"}], "max_tokens": 2}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=spoofed) as r:
                await r.read()
                statuses.append(r.status)
                answered.append(r.headers.get("x-replica-name", ""))
        received: list[dict[str, str]] = []
        for member in gw.members:
            async with http.get(f"http://{member.address}/received_headers") as r:
                received += json.loads(await r.read())
    return statuses, answered, received


def assert_routed_nowhere_named(
    statuses: list[int], answered: list[str], received: list[dict[str, str]], connections: list[int]
) -> None:
    names = trusted_headers()
    assert statuses == [200] * REQUESTS, statuses
    assert len(set(answered)) > 1, answered  # spread by Envoy, not pinned to the one named
    leaked = [{k: v for k, v in h.items() if k in names} for h in received]
    assert not any(leaked), leaked
    assert connections == []


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_a_shipped_scenario_routes_no_client_header_with_the_processor_stopped(scenario: str) -> None:
    require_binary("envoy")
    with trap() as (address, connections):
        gateway = ScenarioGateway(
            config_path=ROOT / "envoy" / scenario / "envoy.yaml",
            time_scale=0.02,
            **SCENARIOS[scenario],  # type: ignore[arg-type]
        )
        with gateway as gw:
            statuses, answered, received = await attack(gw, address)
        assert_routed_nowhere_named(statuses, answered, received, connections)


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    """The main listener's connection manager, without our early removal of the trusted headers
    (another gateway's connection manager is not ours)."""
    listener = config["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm.pop("early_header_mutation_extensions", None)
    return hcm


def istio_gateway(envoy_filter: dict[str, Any], processor: str, replicas: list[str]) -> Callable[[str], str]:
    """An edit of LocalGateway's rendered config into a stand-in of Istio's ingress gateway
    (its own chain: only the router; the model servers' cluster as Istio makes it) with
    ``envoy_filter`` applied as Istio applies it, the processor's cluster at ``processor``."""
    models = "outbound|8000||vllm.llm.svc.cluster.local"

    def edit(rendered: str) -> str:
        config = yaml.safe_load(rendered)
        hcm = _hcm(config)
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == ROUTER_FILTER]
        hcm["route_config"]["virtual_hosts"][0]["routes"] = [
            {"match": {"prefix": "/"}, "route": {"cluster": models, "timeout": "30s"}}
        ]
        endpoints = [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": int(p)}}}}
            for h, p in (r.rsplit(":", 1) for r in replicas)
        ]
        host, port = processor.rsplit(":", 1)
        processor_cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "extproc")
        processor_cluster = {**processor_cluster, "name": "outbound|9002||extproc.llm.svc.cluster.local"}
        processor_cluster["load_assignment"] = {
            "cluster_name": processor_cluster["name"],
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
                    ]
                }
            ],
        }
        config["static_resources"]["clusters"] += [
            processor_cluster,
            {
                "name": models,
                "type": "STATIC",
                "connect_timeout": "5s",
                "lb_policy": "ROUND_ROBIN",
                "load_assignment": {"cluster_name": models, "endpoints": [{"lb_endpoints": endpoints}]},
            },
        ]
        apply_istio_patches(config, envoy_filter)
        assert hcm["http_filters"][0]["name"] == STRIP_FILTER
        return yaml.safe_dump(config, sort_keys=False)

    return edit


def inference_gateway(strip: dict[str, Any] | None) -> Callable[[str], str]:
    """An edit of LocalGateway's rendered endpoint-mode config into a GIE inference gateway's
    chain (the endpoint picker's ext_proc, then the router to the pool's endpoints by
    ``x-gateway-destination-endpoint``), without our strip: with ``strip`` (the Istio overlay's
    EnvoyFilter) applied and failing open; without, failing closed as the overlay's pool does."""

    def edit(rendered: str) -> str:
        config = yaml.safe_load(rendered)
        hcm = _hcm(config)
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != STRIP_FILTER]
        ext_proc = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC_FILTER)
        ext_proc["typed_config"]["failure_mode_allow"] = strip is not None
        if strip is not None:
            apply_istio_patches(config, strip)
            assert hcm["http_filters"][0]["name"] == STRIP_FILTER
        return yaml.safe_dump(config, sort_keys=False)

    return edit


def k8s_object(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(path.read_text())
    return found


async def test_the_istio_filter_routes_no_client_header_with_the_processor_stopped() -> None:
    require_binary("envoy")
    envoy_filter = k8s_object(ROOT / "k8s" / "overlays" / "istio" / "envoyfilter.yaml")
    with trap() as (address, connections):
        gw = LocalGateway(replicas=3, mode="endpoint", time_scale=0.02)
        gw.envoy_yaml_edit = istio_gateway(
            envoy_filter, f"127.0.0.1:{gw.processor_port}", [m.address for m in gw.members]
        )
        with gw:
            statuses, answered, received = await attack(gw, address)
        assert_routed_nowhere_named(statuses, answered, received, connections)


async def test_the_gie_overlay_for_istio_routes_no_client_header_with_the_picker_stopped() -> None:
    require_binary("envoy")
    strip = k8s_object(ROOT / "k8s" / "components" / "istio-header-strip" / "envoyfilter.yaml")
    with trap() as (address, connections):
        with LocalGateway(replicas=3, mode="endpoint", time_scale=0.02, envoy_yaml_edit=inference_gateway(strip)) as gw:
            statuses, answered, received = await attack(gw, address)
        assert_routed_nowhere_named(statuses, answered, received, connections)


async def test_the_gie_overlay_elsewhere_fails_closed_with_the_picker_stopped() -> None:
    """Any other GIE implementation has no strip of ours: its pool fails closed, so with the
    picker down nothing at all reaches a pod."""
    require_binary("envoy")
    pool = yaml.safe_load((ROOT / "k8s" / "overlays" / "inference-pool" / "inferencepool.yaml").read_text())
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    closed = LocalGateway(replicas=3, mode="endpoint", time_scale=0.02, envoy_yaml_edit=inference_gateway(None))
    with trap() as (address, connections), closed as gw:
        statuses, _, received = await attack(gw, address)
    assert all(status >= 500 for status in statuses), statuses
    assert received == [] and connections == []
