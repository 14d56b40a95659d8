"""Config validation: every error names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import ConfigError, config_from_mapping, load_config, parse_replica

GOOD = {
    "mode": "endpoint",
    "replicas": [{"name": "a", "address": "127.0.0.1:8001"}, {"name": "b", "address": "127.0.0.1:8002", "weight": 2}],
    "sessions": {"ttl_s": 60},
    "request": {"session_sources": ["header:x-conversation", "body:user"]},
}


def test_good_config() -> None:
    cfg = config_from_mapping(GOOD)
    assert cfg.mode == "endpoint" and cfg.replicas[1].weight == 2 and cfg.session_ttl_s == 60
    assert cfg.features.session_sources[0].name == "x-conversation"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mode": "magic"}, "mode"),
        ({"replicas": [{"name": "a"}]}, "replicas[0]"),
        ({"replicas": [{"name": "a", "address": "nohost"}]}, "replicas[0].address"),
        ({"replicas": [{"name": "a", "address": "h:1", "weight": 0}]}, "replicas[0].weight"),
        ({"sessions": {"ttl_s": "long"}}, "sessions.ttl_s"),
        ({"request": {"session_sources": ["nope"]}}, "request.session_sources"),
        ({"profile": {"scorers": [{"type": "psychic"}]}}, "profile.scorers[0]"),
        ({"profile": {"filters": [{"type": "overload", "parameters": {"bogus": 1}}]}}, "profile.filters[0]"),
        ({"surprise": 1}, "surprise"),
        ({"store": "mongodb://x"}, "store"),
        ({"store": "redis://x:1,y:2"}, "store"),
    ],
)
def test_errors_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_from_mapping({**GOOD, **change})


def test_load_config_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("mode: cluster\nreplicas:\n  - {name: a, address: '127.0.0.1:1'}\n")
    assert load_config(path).replicas[0].name == "a"
    path.write_text("mode: [unbalanced\n")
    with pytest.raises(ConfigError):
        load_config(path)


def test_parse_replica_flag() -> None:
    assert parse_replica("a=127.0.0.1:80").name == "a"
    with pytest.raises(ConfigError):
        parse_replica("a=127.0.0.1")


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("mode: sideways\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "mode" in capsys.readouterr().err


def test_example_config_loads() -> None:
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "examples" / "router.yaml")
    assert len(cfg.replicas) == 3 and cfg.replicas[2].weight == 2


def test_classes_and_tenants_example_loads(tmp_path: Path) -> None:
    import yaml

    from extproc.request.tenant import api_key_digest
    from tests.conftest import ROOT

    raw = yaml.safe_load((ROOT / "examples" / "classes-and-tenants.yaml").read_text())
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(f"{api_key_digest('sk-a')}: team-a\n")
    raw["tenants"]["api_keys_file"] = str(keys)
    cfg = config_from_mapping(raw)
    assert [r.name for r in cfg.features.classes] == ["batch", "multimodal", "long-context", "short"]
    assert cfg.tenants.definitions["trial"].retry_after_s == 5 and "throughput" in cfg.profiles


def test_health_listen_and_response_sample_rate_are_read_and_checked() -> None:
    cfg = config_from_mapping(
        {**GOOD, "grpc": {"health_listen": "0.0.0.0:9003"}, "health": {"response_sample_rate": 0.25}}
    )
    assert cfg.health_listen == "0.0.0.0:9003"
    assert cfg.health.response_sample_rate == 0.25
    assert config_from_mapping(GOOD).health_listen is None
    with pytest.raises(ConfigError, match="response_sample_rate"):
        config_from_mapping({**GOOD, "health": {"response_sample_rate": 1.5}})
