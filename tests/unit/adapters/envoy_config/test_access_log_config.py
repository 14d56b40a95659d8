"""Envoy's access log: rendered only when asked for, the processor's fields only where it is in the
chain, accepted by the real ``envoy --mode validate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.adapters.cli import main
from extproc.adapters.envoy_config import GatewaySpec, render, render_yaml
from extproc.routing import Replica
from tests.helpers import validate

REPLICAS = [Replica("a", "127.0.0.1:8001")]


def _hcms(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each listener's connection manager, by listener name."""
    listeners = rendered["static_resources"]["listeners"]
    return {
        lst["name"]: lst["filter_chains"][0]["filters"][0]["typed_config"]
        for lst in listeners
        if lst["filter_chains"][0]["filters"][0]["name"] == "envoy.filters.network.http_connection_manager"
    }


def test_without_a_path_no_access_log_is_rendered() -> None:
    assert all("access_log" not in hcm for hcm in _hcms(render(GatewaySpec(replicas=REPLICAS))).values())


def test_a_path_gives_each_listener_a_json_log_with_the_processor_fields_where_it_runs(tmp_path: Path) -> None:
    spec = GatewaySpec(replicas=REPLICAS, round_robin_listen="127.0.0.1:10001", access_log=str(tmp_path / "a.log"))
    hcms = _hcms(render(spec))
    formats = {}
    for name, hcm in hcms.items():
        (log,) = hcm["access_log"]
        assert log["typed_config"]["path"] == str(tmp_path / "a.log")
        formats[name] = log["typed_config"]["log_format"]["json_format"]
    assert formats["gateway"]["ext_proc_request_body_total_latency_us"] == (
        "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)%"
    )
    assert not any(k.startswith("ext_proc_") for k in formats["round_robin"])
    assert formats["gateway"]["upstream_sent_us"] == formats["round_robin"]["upstream_sent_us"]
    # Nothing a client wrote but its method and path: no header that could carry a key or a session.
    commands = " ".join(formats["gateway"].values())
    assert "%REQ(" in commands and all(h in ("X-REQUEST-ID", ":METHOD", ":PATH") for h in _requested(commands))
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(spec))
    validate(path)


def _requested(commands: str) -> list[str]:
    return [part.split(")")[0] for part in commands.split("%REQ(")[1:]]


def test_the_flag_renders_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--replica", "a=127.0.0.1:8001", "--access-log", "/dev/stdout"]) == 0
    assert "envoy.access_loggers.file" in capsys.readouterr().out
