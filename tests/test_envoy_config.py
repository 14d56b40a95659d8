"""Every Envoy config we ship or render passes ``envoy --mode validate`` with the real binary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.envoy_config import GatewaySpec, render, render_yaml
from extproc.routing import Replica
from tests.conftest import ROOT, require_binary

SHIPPED = sorted((ROOT / "envoy").glob("*/envoy.yaml"))
EXAMPLE_REPLICAS = ["replica-0=127.0.0.1:8001", "replica-1=127.0.0.1:8002", "replica-2=127.0.0.1:8003"]


def validate(path: Path) -> None:
    envoy = require_binary("envoy")
    result = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shipped_configs_exist() -> None:
    assert {p.parent.name for p in SHIPPED} >= {"cluster-mode", "endpoint-mode", "endpoint-original-dst"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_config_validates(path: Path) -> None:
    validate(path)


@pytest.mark.parametrize(
    ("folder", "flags"),
    [
        ("cluster-mode", ["--mode", "cluster"]),
        ("endpoint-mode", ["--mode", "endpoint"]),
        ("endpoint-original-dst", ["--mode", "endpoint", "--endpoint-cluster", "original_dst"]),
    ],
)
def test_shipped_config_is_what_the_renderer_produces(
    folder: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["envoy-config", *flags, "--processor", "127.0.0.1:9002"]
    argv += [f"--replica={r}" for r in EXAMPLE_REPLICAS]
    assert main(argv) == 0
    assert capsys.readouterr().out == (ROOT / "envoy" / folder / "envoy.yaml").read_text()


@pytest.mark.parametrize(
    ("mode", "endpoint_cluster"), [("cluster", ""), ("endpoint", "override_host"), ("endpoint", "original_dst")]
)
def test_rendered_with_unix_socket_processor_and_round_robin_listener_validates(
    mode: str, endpoint_cluster: str, tmp_path: Path
) -> None:
    spec = GatewaySpec(
        replicas=[Replica(f"r{i}", f"127.0.0.1:{8000 + i}") for i in range(4)],
        processor=f"unix:{tmp_path}/p.sock",
        mode=mode,
        endpoint_cluster=endpoint_cluster or "override_host",
        round_robin_listen="127.0.0.1:10001",
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


def test_client_routing_headers_are_stripped_before_ext_proc() -> None:
    spec = GatewaySpec(replicas=[Replica("a", "127.0.0.1:1")])
    hcm = render(spec)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names.index("envoy.filters.http.header_mutation") < names.index("envoy.filters.http.ext_proc")
    ext_proc = hcm["http_filters"][names.index("envoy.filters.http.ext_proc")]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["cluster"] == "replicas_round_robin"
