"""The router started as GIE's inferencepool chart starts its picker: flags, no command."""

from __future__ import annotations

import logging

import pytest

from extproc.adapters.cli import build_parser, main
from extproc.adapters.server.self_signed import serves_self_signed
from extproc.config.cli_flags import config_from_flags
from extproc.config.picker_invocation import apply_picker_flags, as_serve, report_picker_flags
from extproc.fleet.discovery.settings import InferencePoolSource

# The arguments GIE's chart gives its picker's container (its epp Deployment, a single replica,
# tracing off), with a release named qwen in namespace llm.
CHART_ARGS = [
    "--pool-name",
    "qwen",
    "--pool-namespace",
    "llm",
    "--pool-group",
    "inference.networking.k8s.io",
    "--zap-encoder",
    "json",
    "--config-file",
    "/config/default-plugins.yaml",
    "--tracing=false",
    "--metrics-endpoint-auth=false",
]


def test_the_charts_command_line_is_serve_as_the_picker_with_its_ports(caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(as_serve(CHART_ARGS))
    assert args.command == "serve"
    apply_picker_flags(args)
    assert args.log_format == "json"
    cfg = config_from_flags(None, args, environ={})
    assert cfg.discovery == InferencePoolSource(name="qwen", namespace="llm")
    assert (cfg.listen, cfg.grpc.health_listen, cfg.metrics.address) == ("0.0.0.0:9002", "0.0.0.0:9003", "0.0.0.0:9090")
    assert cfg.mode == "endpoint"  # GIE's protocol: x-gateway-destination-endpoint and envoy.lb metadata
    # TLS with a self-signed certificate, as GIE's picker serves by default.
    assert serves_self_signed(cfg.grpc.tls is not None, cfg.grpc.secure_serving, cfg.discovery.type, cfg.listen)
    with caplog.at_level(logging.WARNING, logger="extproc.config"):
        report_picker_flags(args)
    assert "--config-file=/config/default-plugins.yaml: a flag of GIE's picker with no meaning here" in caplog.text
    # A port flag of the chart's own (inferenceExtension.flags) wins over the picker's default.
    later = build_parser().parse_args(as_serve([*CHART_ARGS, "--grpc-port=9443"]))
    assert config_from_flags(None, later, environ={}).listen == "0.0.0.0:9443"


def test_the_commands_and_the_version_are_left_alone() -> None:
    assert as_serve(["serve", "--replica", "a=127.0.0.1:1"])[0] == "serve"
    assert as_serve(["--version"]) == ["--version"] and as_serve([]) == []


def test_a_pool_group_not_followed_and_an_unknown_flag_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--pool-name", "qwen", "--pool-group", "inference.networking.x-k8s.io"])
    assert stopped.value.code == 2
    assert "--pool-group: only inference.networking.k8s.io InferencePools (v1) are followed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["--pool-name", "qwen", "--endpoint-selector", "app=vllm"])
    assert refused.value.code == 2 and "--endpoint-selector" in capsys.readouterr().err
