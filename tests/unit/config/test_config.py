"""Config validation: every error names its field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from extproc.adapters.cli import main
from extproc.config import Config, ConfigError, config_from_mapping, load_config, parse_replica

GOOD = {
    "mode": "endpoint",
    "replicas": [{"name": "a", "address": "127.0.0.1:8001"}, {"name": "b", "address": "127.0.0.1:8002", "weight": 2}],
    "sessions": {"ttl_s": 60},
    "request": {"session_sources": ["header:x-conversation", "body:user"]},
}


def test_good_config() -> None:
    cfg = config_from_mapping(GOOD)
    assert cfg.mode == "endpoint" and cfg.replicas[1].weight == 2 and cfg.sessions.ttl_s == 60
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


def test_a_replicas_kv_event_endpoints_in_the_file_are_the_flags_labels(tmp_path: Path) -> None:
    from extproc.fleet.kvevents.endpoints import rank_endpoints
    from extproc.fleet.kvevents.settings import KvEventSettings

    path = tmp_path / "router.yaml"
    path.write_text(
        "replicas:\n"
        "  - name: a\n"
        "    address: '10.0.0.1:8000'\n"
        "    kv_events: 'tcp://10.0.0.1:5557'\n"
        "    kv_replay: 'tcp://10.0.0.1:5558'\n"
        "    kv_dp: 2\n"
        "    labels: {pool: gold}\n"
        "  - {name: b, address: '10.0.0.2:8000'}\n"
    )
    a, b = load_config(path).replicas
    flag = parse_replica(
        "a=10.0.0.1:8000,pool=gold,kv_events=tcp://10.0.0.1:5557,kv_replay=tcp://10.0.0.1:5558,kv_dp=2"
    )
    assert a == flag
    assert rank_endpoints(a, KvEventSettings()) == [
        ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5559"),  # rank 1 on port + 1, as vLLM
    ]
    assert rank_endpoints(b, KvEventSettings()) == [] and b.labels == {}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"kv_events": "10.0.0.1:5557"}, "replicas[0].kv_events"),  # not an endpoint URL
        ({"kv_replay": "tcp://h:5558"}, "needs kv_events"),
        ({"kv_events": "tcp://h:1", "labels": {"kv_events": "tcp://h:2"}}, "labels.kv_events says"),
        ({"kv_dp": 0}, "replicas[0].kv_dp"),
    ],
)
def test_a_replicas_kv_event_fields_are_checked(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_mapping({"replicas": [{"name": "a", "address": "h:1", **entry}]})


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("mode: sideways\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "mode" in capsys.readouterr().err


def test_example_config_is_generated_from_the_schema_and_loads() -> None:
    from extproc.config.example import example_yaml
    from extproc.routing.registry import DEFAULT_PROFILE, build_profile
    from tests.conftest import ROOT

    path = ROOT / "examples" / "router.yaml"
    assert path.read_text() == example_yaml(), "run `make example-config`"
    cfg = load_config(path)
    assert len(cfg.replicas) == 3 and cfg.replicas[2].weight == 2
    assert cfg.replicas[0].labels == {"kv_events": "tcp://127.0.0.1:5557"}
    # Every default it spells out is the default: the example's profile builds the shipped one.
    assert build_profile(cfg.profile) == build_profile(DEFAULT_PROFILE)
    assert cfg.health == Config().health and cfg.rebalance == Config().rebalance


def _plugin(section: str, kind: str, type_: str, **parameters: object) -> dict[str, object]:
    return {section: {kind: [{"type": type_, "parameters": parameters}]}}


# One typo per section of the file, and plugin parameters of the wrong type or name.
SECTION_TYPOS = [
    ({"headers": {"target_clustr": "x"}}, "headers.target_clustr"),
    ({"replicas": [{"name": "a", "address": "h:1", "wieght": 2}]}, "replicas[0].wieght"),
    ({"sessions": {"ttl": 60}}, "sessions.ttl"),
    ({"request": {"max_body": 1}}, "request.max_body"),
    ({"prefix": {"block_char": 64}}, "prefix.block_char"),
    ({"ring": {"vnode": 1}}, "ring.vnode"),
    ({"metrics": {"listn": "x"}}, "metrics.listn"),
    ({"grpc": {"max_message": 1}}, "grpc.max_message"),
    ({"grpc": {"tls": {"cert_file": "/c", "key_file": "/k", "ca": "/x"}}}, "grpc.tls.ca"),
    ({"health": {"eject_s": 5}}, "health.eject_s"),
    ({"health": {"weights": {"queues": 1}}}, "health.weights.queues"),
    ({"health": {"limits": {"queue": 1}}}, "health.limits.queue"),
    ({"spillover": {"re_pin": True}}, "spillover.re_pin"),
    ({"rebalance": {"enable": False}}, "rebalance.enable"),
    ({"rebalance": {"prewarm": {"rate": 1}}}, "rebalance.prewarm.rate"),
    ({"tenants": {"per_replicas": 1}}, "tenants.per_replicas"),
    ({"tenants": {"definitions": {"t": {"max_concurent": 1}}}}, "tenants.definitions.t.max_concurent"),
    ({"classes": [{"name": "x", "match": {"colour": "red"}}]}, "classes[0].match.colour"),
    ({"classes": [{"name": "x", "pol": {}}]}, "classes[0].pol"),
    ({"profile": {"scorer": []}}, "profile.scorer"),
    ({"profiles": {"p": {"filters": [{"type": "pool", "params": {}}]}}}, "profiles.p.filters[0].params"),
    ({"discovery": {"type": "dns", "name": "x", "port": 80, "intervl_s": 1}}, "discovery.intervl_s"),
    ({"sessions": {"ttl_s": True}}, "sessions.ttl_s"),
    ({"kv_events": {"tokenizer": {"m": "/d"}}}, "kv_events.tokenizer"),
    ({"kv_events": {"block_size": "16"}}, "kv_events.block_size"),
    ({"kv_events": {"stale_after_s": "5s"}}, "kv_events.stale_after_s"),
    ({"health": {"eject_after": 0}}, "health.eject_after"),
    (
        {"profile": {"filters": [{"type": "overload", "parameters": {"kv_threshold": "high"}}]}},
        "profile.filters[0].parameters.kv_threshold",
    ),
    (
        {"profile": {"scorers": [{"type": "load", "parameters": {"work_weigth": 1}}]}},
        "profile.scorers[0].parameters.work_weigth",
    ),
    (
        {"profiles": {"p": {"scorers": [{"type": "ring", "parameters": {"load_factor": "x"}}]}}},
        "profiles.p: profile.scorers[0].parameters.load_factor",
    ),
]


@pytest.mark.parametrize(("raw", "path"), SECTION_TYPOS)
def test_check_config_names_the_path_of_a_typo_in_every_section(
    raw: dict[str, object], path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    file = tmp_path / "router.yaml"
    file.write_text(yaml.safe_dump(raw))
    assert main(["check-config", str(file)]) == 2
    assert f"{path}:" in capsys.readouterr().err


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
    assert cfg.grpc.health_listen == "0.0.0.0:9003"
    assert cfg.health.response_sample_rate == 0.25
    assert config_from_mapping(GOOD).grpc.health_listen is None
    with pytest.raises(ConfigError, match="response_sample_rate"):
        config_from_mapping({**GOOD, "health": {"response_sample_rate": 1.5}})
