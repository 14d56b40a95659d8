"""Config validation: every error names its field."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from extproc.cli import main
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
    from extproc.kvevents.cache_state import rank_endpoints
    from extproc.kvevents.settings import KvEventSettings

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


def _model(annotation: object, kind: str | None = None) -> type[BaseModel] | None:
    """The section model a field holds (``X | None`` too; of a union of kinds, the one whose
    ``type`` is ``kind``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _model(args[0], kind)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    if kind is not None:
        models = [m for m in models if "type" in m.model_fields and m.model_fields["type"].default == kind]
    return models[0] if models else None


def test_every_serve_flag_that_sets_config_is_a_key_of_the_file_and_shows_it() -> None:
    from extproc.cli import build_parser
    from extproc.config.cli_flags import SERVE_FLAGS

    for flag in SERVE_FLAGS:
        model: type[BaseModel] | None = Config
        *sections, last = flag.key.split(".")
        for name in sections:
            assert model is not None and name in model.model_fields, flag.name
            kind = flag.implies[1] if flag.implies is not None and flag.implies[0] == f"{name}.type" else None
            model = _model(model.model_fields[name].annotation, kind)
        assert model is not None and last in model.model_fields, f"{flag.name}: no key {flag.key}"
        if flag.switch is not None:
            assert flag.switch.rpartition(".")[0] == flag.key.rpartition(".")[0]
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    options = {o for action in serve._actions for o in action.option_strings}
    not_config = {"-h", "--help", "--config", "--log-level", "--log-format"}
    assert options - not_config == {f.name for f in SERVE_FLAGS}
    help_text = serve.format_help()
    assert all(f"[config {f.key}; env {f.env}]" in " ".join(help_text.split()) for f in SERVE_FLAGS)


def test_a_replicas_per_replica_keys_are_the_replica_flags_labels() -> None:
    from extproc.config import REPLICA_KV_FIELDS, ReplicaEntry

    # Every key of a replicas: entry can be given with --replica (NAME=HOST:PORT, its labels, its
    # KV-event endpoints as labels) but its weight, which a flag's replica keeps at 1.
    assert set(ReplicaEntry.model_fields) == {"name", "address", "labels", "weight", *REPLICA_KV_FIELDS}
    flag = parse_replica("a=h:1,pool=gold,kv_events=tcp://h:2,kv_replay=tcp://h:3,kv_dp=2")
    entry = {"name": "a", "address": "h:1", "labels": {"pool": "gold"}}
    kv = {"kv_events": "tcp://h:2", "kv_replay": "tcp://h:3", "kv_dp": 2}
    assert config_from_mapping({"replicas": [{**entry, **kv}]}).replicas == (flag,)


def test_flags_override_the_file_and_are_checked_as_its_keys(tmp_path: Path) -> None:
    import argparse

    from extproc.config.cli_flags import add_config_flags, config_from_flags

    path = tmp_path / "router.yaml"
    path.write_text("metrics: {enabled: false}\nkv_events: {tokenizers: {a: /a}}\nsessions: {ttl_s: 60}\n")
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_flags(path, parser.parse_args(["--metrics-listen", "127.0.0.1:1", "--tokenizer", "b=/b"]))
    assert cfg.metrics.address == "127.0.0.1:1" and cfg.kv_events.tokenizers == {"a": "/a", "b": "/b"}
    assert cfg.sessions.ttl_s == 60
    assert config_from_flags(None, parser.parse_args(["--metrics-listen", "off"])).metrics.address is None
    with pytest.raises(ConfigError, match=re.escape("health.response_sample_rate (--response-sample-rate):")):
        config_from_flags(None, parser.parse_args(["--response-sample-rate", "1.5"]))
    with pytest.raises(ConfigError, match=re.escape("store (--store):")):
        config_from_flags(None, parser.parse_args(["--store", "mongodb://x"]))


def test_the_disaggregation_section_reaches_the_pair_and_is_checked() -> None:
    cfg = config_from_mapping({"disaggregation": {"threshold_tokens": 512, "weigh_local": False}})
    pairing = cfg.disaggregation.pair_settings(block_tokens=16)
    assert (pairing.threshold_tokens, pairing.weigh_local, pairing.block_tokens) == (512, False, 16)
    with pytest.raises(ConfigError, match=r"disaggregation\.threshold_tokens"):
        config_from_mapping({"disaggregation": {"threshold_tokens": -1}})
    with pytest.raises(ConfigError, match=r"disaggregation\.threshold: unknown key"):
        config_from_mapping({"disaggregation": {"threshold": 5}})
    assert "x-prefiller-host-port" in cfg.routing_headers  # a client never names a prefill replica


def _serve_args(*argv: str) -> object:
    import argparse

    from extproc.config.cli_flags import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser.parse_args(list(argv))


def test_every_serve_flag_is_an_environment_variable_below_the_flag_and_above_the_file(tmp_path: Path) -> None:
    import argparse

    from extproc.config.cli_flags import SERVE_FLAGS, config_from_flags

    names = [f.env for f in SERVE_FLAGS]
    assert len(set(names)) == len(names) and all(n.startswith("EXTPROC_") and n.isupper() for n in names)
    assert next(f for f in SERVE_FLAGS if f.name == "--metrics-listen").env == "EXTPROC_METRICS_LISTEN"
    path = tmp_path / "router.yaml"
    path.write_text("listen: 127.0.0.1:7000\nsessions: {ttl_s: 60}\nkv_events: {tokenizers: {a: /a}}\n")
    env = {
        "EXTPROC_LISTEN": "127.0.0.1:7001",
        "EXTPROC_MODE": "endpoint",
        "EXTPROC_WORKERS": "1",
        "EXTPROC_REPLICA": "a=10.0.0.1:8000,pool=gold  b=10.0.0.2:8000",
        "EXTPROC_TOKENIZER": "b=/b",
        "EXTPROC_METRICS_LISTEN": "off",
        "EXTPROC_RESPONSE_SAMPLE_RATE": "0.5",
        "EXTPROC_STORE": "",  # empty: unset
    }
    args = _serve_args()
    assert isinstance(args, argparse.Namespace)
    cfg = config_from_flags(path, args, environ=env)
    assert cfg.listen == "127.0.0.1:7001" and cfg.mode == "endpoint" and cfg.metrics.address is None
    assert [(r.name, r.address, dict(r.labels)) for r in cfg.replicas] == [
        ("a", "10.0.0.1:8000", {"pool": "gold"}),
        ("b", "10.0.0.2:8000", {}),
    ]
    assert cfg.kv_events.tokenizers == {"a": "/a", "b": "/b"} and cfg.health.response_sample_rate == 0.5
    assert cfg.sessions.ttl_s == 60 and cfg.store == "memory://"
    # A flag wins over its variable.
    flagged = _serve_args("--listen", "127.0.0.1:7002", "--replica", "c=10.0.0.3:8000")
    assert isinstance(flagged, argparse.Namespace)
    cfg = config_from_flags(path, flagged, environ=env)
    assert cfg.listen == "127.0.0.1:7002" and [r.name for r in cfg.replicas] == ["c"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EXTPROC_WORKERS": "two"}, "EXTPROC_WORKERS: not a valid integer: 'two'"),
        ({"EXTPROC_RESPONSE_SAMPLE_RATE": "half"}, "EXTPROC_RESPONSE_SAMPLE_RATE: not a valid number: 'half'"),
        ({"EXTPROC_MODE": "magic"}, "EXTPROC_MODE: expected one of cluster, endpoint, got 'magic'"),
        ({"EXTPROC_RESPONSE_SAMPLE_RATE": "1.5"}, "health.response_sample_rate (EXTPROC_RESPONSE_SAMPLE_RATE):"),
        ({"EXTPROC_STORE": "mongodb://x"}, "store (EXTPROC_STORE):"),
        ({"EXTPROC_TOKENIZER": "nodir"}, "--tokenizer: expected MODEL=DIR, got 'nodir'"),
        ({"EXTPROC_TLS_CERT": "/c.pem"}, "--tls-cert and --tls-key: both are needed"),
    ],
)
def test_a_bad_variable_is_refused_as_its_flag_would_be_naming_it(env: dict[str, str], message: str) -> None:
    import argparse

    from extproc.config.cli_flags import config_from_flags

    args = _serve_args()
    assert isinstance(args, argparse.Namespace)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_flags(None, args, environ=env)


def test_the_command_line_reads_its_variables_and_tells_its_version(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from importlib.metadata import version

    import extproc

    assert extproc.__version__ == version("extproc-router")
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.strip() == f"extproc {extproc.__version__}"
    path = tmp_path / "router.yaml"
    path.write_text("mode: magic\n")
    monkeypatch.setenv("EXTPROC_CONFIG", str(path))
    assert main(["serve"]) == 2
    assert "config error: mode (--mode): Input should be" in capsys.readouterr().err  # the file was read
    monkeypatch.setenv("EXTPROC_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        main(["serve"])
    assert "EXTPROC_LOG_FORMAT: expected one of text, json, got 'xml'" in capsys.readouterr().err


def test_gies_picker_flags_mean_the_same_here_and_errors_name_the_flag_given(tmp_path: Path) -> None:
    import argparse

    from extproc.config.cli_flags import add_config_flags, config_from_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    argv = "--pool-name vllm --pool-namespace llm --grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090"
    cfg = config_from_flags(None, parser.parse_args([*argv.split(), "--cert-path", "/etc/certs/"]), environ={})
    assert (cfg.listen, cfg.grpc.health_listen, cfg.metrics.address) == ("0.0.0.0:9002", "0.0.0.0:9003", "0.0.0.0:9090")
    assert cfg.grpc.tls is not None
    assert (cfg.grpc.tls.cert_file, cfg.grpc.tls.key_file) == ("/etc/certs/tls.crt", "/etc/certs/tls.key")
    with pytest.raises(SystemExit):
        parser.parse_args(["--grpc-port", "70000"])
    with pytest.raises(ConfigError, match=re.escape("EXTPROC_METRICS_PORT: not a valid port: 'x'")):
        config_from_flags(None, parser.parse_args([]), environ={"EXTPROC_METRICS_PORT": "x"})
    # An error about a key names the flag that set it, and a key is matched whole.
    bad = tmp_path / "router.yaml"
    bad.write_text("metrics: {listen: [1]}\n")
    with pytest.raises(ConfigError) as raised:
        config_from_flags(bad, parser.parse_args([]), environ={})
    assert "metrics.listen (--metrics-listen):" in str(raised.value)
    bad.write_text("listen: [1]\n")
    with pytest.raises(ConfigError, match=re.escape("listen (--listen): Input should be")):
        config_from_flags(bad, parser.parse_args([]), environ={})
