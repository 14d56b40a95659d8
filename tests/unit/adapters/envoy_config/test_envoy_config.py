"""Every Envoy config we ship or render passes ``envoy --mode validate`` with the real binary,
and the shipped files are exactly what ``extproc envoy-config`` renders."""

from __future__ import annotations

import datetime
from pathlib import Path

import pydantic
import pytest
import yaml
from envoy_data_plane.envoy.config.cluster.v3 import Cluster
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpConnectionManager

from extproc.adapters.cli import build_parser, main
from extproc.adapters.envoy_config import SCENARIOS, GatewaySpec, bootstrap, render, render_yaml
from extproc.adapters.envoy_config.command import spec_from_args
from extproc.config import load_config
from extproc.routing import Replica
from extproc_lab.demo.scenario import SHIPPED_REPLICAS
from tests.conftest import ROOT
from tests.helpers import validate

ENVOY_DIR = ROOT / "envoy"
SHIPPED = sorted(ENVOY_DIR.glob("*/envoy.yaml"))
# The k8s scenario is rendered from the k8s router config and lives in k8s/ (tests/project/test_k8s.py).
FOLDER_SCENARIOS = sorted(name for name in SCENARIOS if name != "kubernetes")
REPLICA_FLAGS = [f"--replica={r.name}={r.address}" for r in SHIPPED_REPLICAS]


def test_every_scenario_has_a_folder_with_readme_config_and_verify_script() -> None:
    assert {p.parent.name for p in SHIPPED} == set(FOLDER_SCENARIOS)
    assert {"cluster-mode", "endpoint-mode"} <= set(FOLDER_SCENARIOS)
    for name in FOLDER_SCENARIOS:
        for file in ("README.md", "envoy.yaml", "verify.py"):
            assert (ENVOY_DIR / name / file).is_file(), f"envoy/{name}/{file}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_config_validates(path: Path) -> None:
    validate(path)


@pytest.mark.parametrize("scenario", FOLDER_SCENARIOS)
def test_shipped_config_is_what_the_renderer_produces(scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--scenario", scenario, *REPLICA_FLAGS]) == 0
    assert capsys.readouterr().out == (ENVOY_DIR / scenario / "envoy.yaml").read_text()


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
        health_check_path="/health",
        probe_listen="127.0.0.1:10002",
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


def test_client_routing_headers_are_stripped_before_ext_proc() -> None:
    spec = GatewaySpec(replicas=[Replica("a", "127.0.0.1:1")])
    hcm = render(spec)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    removed = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert removed == [
        {"remove": "x-target-cluster"},
        {"remove": "x-gateway-destination-endpoint"},
        {"remove": "x-extproc-stream"},
        {"remove": "x-envoy-upstream-rq-per-try-timeout-ms"},
        {"remove": "x-prefiller-host-port"},
        {"remove": "x-tenant-id"},
    ]
    ext_proc = hcm["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["cluster"] == "replicas_round_robin"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_strips_every_trusted_header_first(scenario: str, tmp_path: Path) -> None:
    # The tenant header named in the config (trusted or not) goes with the routing headers.
    config = tmp_path / "router.yaml"
    mode = SCENARIOS[scenario].mode
    config.write_text(f"mode: {mode}\ntenants: {{header: x-org, trust_header: true}}\n")
    argv = ["envoy-config", "--config", str(config), "--scenario", scenario, *REPLICA_FLAGS]
    spec = spec_from_args(build_parser().parse_args(argv))
    hcm = render(spec)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["name"] == "envoy.filters.http.header_mutation"
    removed = {m["remove"] for m in hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]}
    cfg = load_config(str(config))
    assert {*cfg.routing_headers, *cfg.identity_headers} <= removed
    assert "x-org" in removed
    # And before Envoy picks the route (which it keeps while a processor that is down changes nothing).
    (early,) = hcm["early_header_mutation_extensions"]
    assert {m["remove"] for m in early["typed_config"]["mutations"]} == removed


def test_the_bootstrap_is_a_typed_message_and_wrong_fields_fail_when_built() -> None:
    typed = bootstrap(GatewaySpec(replicas=[Replica("a", "127.0.0.1:1")]))
    assert typed.static_resources is not None
    assert [c.name for c in typed.static_resources.clusters] == ["replicas_round_robin", "extproc", "a"]
    with pytest.raises(pydantic.ValidationError):
        HttpConnectionManager(stat_prefx="typo")  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        Cluster(name="c", connect_timeout="soon")  # type: ignore[arg-type]
    assert Cluster(name="c", connect_timeout=datetime.timedelta(seconds=1)).connect_timeout is not None


def test_failover_scenario_health_checks_and_retries_across_priorities() -> None:
    spec = SCENARIOS["failover"].spec(SHIPPED_REPLICAS)
    clusters = {c["name"]: c for c in render(spec)["static_resources"]["clusters"]}
    own = clusters["replica-0"]
    assert own["health_checks"][0]["http_health_check"]["path"] == "/health"
    priorities = [locality.get("priority", 0) for locality in own["load_assignment"]["endpoints"]]
    assert priorities == [0, 1]
    hcm = render(spec)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routed = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert routed["cluster_header"] == "x-target-cluster"
    assert routed["retry_policy"]["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"


def test_unix_socket_scenario_dials_the_processor_over_a_pipe() -> None:
    clusters = render(SCENARIOS["unix-socket"].spec(SHIPPED_REPLICAS))["static_resources"]["clusters"]
    processor = next(c for c in clusters if c["name"] == "extproc")
    address = processor["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address == {"pipe": {"path": "/run/extproc/extproc.sock"}}


def test_replicas_from_dns_in_endpoint_mode(tmp_path: Path) -> None:
    spec = GatewaySpec(replicas=(), mode="endpoint", replicas_dns="vllm.llm.svc.cluster.local:8000")
    clusters = {c["name"]: c for c in render(spec)["static_resources"]["clusters"]}
    assert clusters["replicas_endpoint"]["type"] == "STRICT_DNS"
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "nope", *REPLICA_FLAGS], "--scenario: expected one of"),
        (["--output", "nope", *REPLICA_FLAGS], "--output: expected one of"),
        (["--scenario", "endpoint-mode"], "replicas: none given"),
        (["--mode", "cluster", "--replicas-dns", "vllm:8000"], "replicas_dns: cluster mode needs"),
        (["--scenario", "endpoint-mode", "--output", "istio-envoyfilter", *REPLICA_FLAGS], "istio-envoyfilter: needs"),
    ],
)
def test_envoy_config_errors_name_the_problem(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_scenario_that_contradicts_the_router_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"mode": "cluster", "replicas": [{"name": "a", "address": "127.0.0.1:1"}]}))
    assert main(["envoy-config", "--config", str(config), "--scenario", "endpoint-mode"]) == 2
    assert "scenario endpoint-mode needs mode endpoint" in capsys.readouterr().err


def test_the_processor_address_comes_from_the_config_listen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump({"listen": "0.0.0.0:9333", "replicas": [{"name": "a", "address": "10.0.0.1:8000"}]})
    )
    assert main(["envoy-config", "--config", str(config)]) == 0
    clusters = yaml.safe_load(capsys.readouterr().out)["static_resources"]["clusters"]
    processor = next(c for c in clusters if c["name"] == "extproc")
    socket = processor["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert socket == {"address": "127.0.0.1", "port_value": 9333}  # a wildcard listen is dialled on loopback


@pytest.mark.parametrize(("workers", "streams"), [(1, None), (4, 1)])
def test_a_processor_with_workers_gets_one_stream_a_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: int, streams: int | None
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": workers, "replicas": [{"name": "a", "address": "10.0.0.1:8000"}]}))
    assert main(["envoy-config", "--config", str(config)]) == 0
    clusters = yaml.safe_load(capsys.readouterr().out)["static_resources"]["clusters"]
    processor = next(c for c in clusters if c["name"] == "extproc")
    (options,) = processor["typed_extension_protocol_options"].values()
    http2 = options["explicit_http_config"]["http2_protocol_options"]
    assert http2.get("max_concurrent_streams") == streams


def test_check_config_accepts_a_good_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "examples" / "router.yaml")]) == 0
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("mode: sideways\n", "mode"),
        ("replicas:\n  - {name: a, address: nowhere}\n", "replicas[0].address"),
        ("sessions:\n  ttl_s: soon\n", "sessions.ttl_s"),
        ("store: ftp://x\n", "store"),
        ("discovery: {type: kubernetes, service: vllm, port: 0}\n", "discovery.port"),
        ("colour: blue\n", "colour"),
    ],
)
def test_check_config_names_the_field_and_exits_2(
    text: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err, err


def test_the_cli_help_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI declares --scenario without importing this module (kept off `extproc serve`).
    with pytest.raises(SystemExit):
        main(["envoy-config", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert all(name in text for name in SCENARIOS), text
