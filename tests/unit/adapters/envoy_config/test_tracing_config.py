"""Envoy's own tracing: the OpenTelemetry tracer and the collector's cluster, rendered only when
asked for, accepted by the real ``envoy --mode validate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.adapters.cli import main
from extproc.adapters.envoy_config import GatewaySpec, render, render_yaml
from extproc.routing import Replica
from tests.helpers import validate

REPLICAS = [Replica("a", "127.0.0.1:8001"), Replica("b", "127.0.0.1:8002")]


def _hcm(rendered: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]


def _clusters(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in rendered["static_resources"]["clusters"]}


def test_without_a_collector_nothing_of_tracing_is_rendered() -> None:
    rendered = render(GatewaySpec(replicas=REPLICAS))
    assert "tracing" not in _hcm(rendered)
    assert "otel_collector" not in _clusters(rendered)


def test_a_collector_gives_the_hcm_an_opentelemetry_tracer_and_a_cluster(tmp_path: Path) -> None:
    spec = GatewaySpec(
        replicas=REPLICAS,
        round_robin_listen="127.0.0.1:10001",
        tracing_collector="127.0.0.1:4317",
        tracing_sample_percent=5,
    )
    rendered = render(spec)
    tracing = _hcm(rendered)["tracing"]
    assert tracing["random_sampling"] == {"value": 5.0}
    assert tracing["spawn_upstream_span"] is True
    provider = tracing["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    otel = provider["typed_config"]
    assert otel["@type"].endswith("envoy.config.trace.v3.OpenTelemetryConfig")
    assert otel["grpc_service"] == {"envoy_grpc": {"cluster_name": "otel_collector"}}
    assert otel["service_name"] == "envoy-gateway"
    collector = _clusters(rendered)["otel_collector"]
    assert collector["type"] == "STATIC"
    options = collector["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]  # OTLP/gRPC
    address = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address == {"socket_address": {"address": "127.0.0.1", "port_value": 4317}}
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


def test_a_collector_named_by_dns_is_resolved(tmp_path: Path) -> None:
    spec = GatewaySpec(replicas=REPLICAS, tracing_collector="otel-collector.observability:4317")
    assert _clusters(render(spec))["otel_collector"]["type"] == "STRICT_DNS"
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tracing_collector": "nowhere"}, "tracing_collector: expected HOST:PORT"),
        ({"tracing_collector": "127.0.0.1:4317", "tracing_sample_percent": 101}, "tracing_sample_percent"),
    ],
)
def test_bad_tracing_values_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render(GatewaySpec(replicas=REPLICAS, **changes))


def test_the_flag_samples_as_the_processor_does_unless_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "tracing:\n  enabled: true\n  sample_rate: 0.25\nreplicas:\n  - name: a\n    address: 127.0.0.1:8001\n"
    )
    assert main(["envoy-config", "--config", str(config), "--tracing-collector", "127.0.0.1:4317"]) == 0
    assert _hcm(yaml.safe_load(capsys.readouterr().out))["tracing"]["random_sampling"] == {"value": 25.0}
    flags = ["--tracing-collector", "127.0.0.1:4317", "--tracing-sample-percent", "100"]
    assert main(["envoy-config", "--config", str(config), *flags]) == 0
    assert _hcm(yaml.safe_load(capsys.readouterr().out))["tracing"]["random_sampling"] == {"value": 100.0}


def test_a_sampling_share_without_a_collector_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--replica", "a=127.0.0.1:8001", "--tracing-sample-percent", "5"]) == 2
    assert "--tracing-sample-percent: needs --tracing-collector" in capsys.readouterr().err
