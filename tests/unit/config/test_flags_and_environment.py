"""The serve flags and the EXTPROC_* variables: made from the config model, checked as the file is,
in the documented order (key flag > hand-named flag > variable > file > default)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from extproc.adapters.cli import build_parser, main
from extproc.base.validation import Section, option
from extproc.config import Config, ConfigError, config_from_mapping, parse_replica
from extproc.config.cli_flags import ALIASES, SWITCHES, add_config_flags, config_from_flags
from extproc.config.keys import _keys_of, config_keys, key
from extproc.config.profiles import ProfileSpec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser


def _config(*argv: str, env: dict[str, str] | None = None, path: Path | None = None) -> Config:
    return config_from_flags(path, _parser().parse_args(list(argv)), environ=env or {})


def test_every_key_is_named_by_the_one_rule() -> None:
    k = key("health.token_timing")
    assert (k.env, k.flag) == ("EXTPROC_HEALTH__TOKEN_TIMING", "--health-token-timing")
    assert key("health.limits.queue_full").env == "EXTPROC_HEALTH__LIMITS__QUEUE_FULL"
    assert key("kv_events.listen").flag == "--kv-events-listen" and key("listen").env == "EXTPROC_LISTEN"
    for k in config_keys():
        assert k.env == "EXTPROC_" + k.path.upper().replace(".", "__")
        assert k.flag == "--" + k.path.replace(".", "-").replace("_", "-")
        assert k.description, f"{k.path}: no doc"


def test_a_field_added_to_any_section_becomes_a_key() -> None:
    class Inner(Section):
        rate: float = option(0.5, "a rate", ge=0)
        mode: str | None = option(None, "a mode")

    class Outer(Section):
        inner: Inner = option(Inner(), "a section")
        table: dict[str, int] = option({}, "a mapping")

    keys = _keys_of(Outer, Outer())
    assert set(keys) == {"inner.rate", "inner.mode", "table"}
    assert (keys["inner.rate"].kind, keys["inner.mode"].nullable, keys["table"].kind) == ("number", True, "yaml")
    assert keys["inner.rate"].env == "EXTPROC_INNER__RATE"


def _dump(cfg: Config) -> dict[str, object]:
    """The config as the file spells it, its profile as read (a profile read gains empty parameters)."""
    out = cfg.model_dump(mode="json")
    out["profile"] = ProfileSpec.model_validate(cfg.profile).mapping()
    return out


def test_every_keys_default_read_back_from_its_variable_and_its_flag_is_the_default() -> None:
    # Each key's default, written as text the way the reference shows it, read through the variable
    # and through the flag, validates to the default config: every key is reachable and its reader
    # takes what the file would.
    defaults = _dump(Config())
    checked = 0
    for k in config_keys():
        if k.default == "required" or k.within or ";" in k.default or k.path.startswith(("grpc.tls.", "admin.tls.")):
            continue  # keys of a section that is null by default, or of one kind of a section, need more
        if k.path in SWITCHES:
            continue  # an address also turns its section on (below)
        assert _dump(_config(env={k.env: k.default})) == defaults, k.env
        assert _dump(_config(k.flag, k.default)) == defaults, k.flag
        checked += 1
    assert checked > 150


def test_a_variable_is_checked_as_the_files_key_and_named() -> None:
    with pytest.raises(ConfigError) as from_file:
        config_from_mapping({"health": {"response_sample_rate": 1.5}})
    with pytest.raises(ConfigError) as from_env:
        _config(env={"EXTPROC_HEALTH__RESPONSE_SAMPLE_RATE": "1.5"})
    tail = str(from_file.value).removeprefix("health.response_sample_rate")
    assert str(from_env.value) == f"health.response_sample_rate (EXTPROC_HEALTH__RESPONSE_SAMPLE_RATE){tail}"
    with pytest.raises(ConfigError, match=re.escape("replicas[0].address (EXTPROC_REPLICAS): expected HOST:PORT")):
        _config(env={"EXTPROC_REPLICAS": "[{name: a, address: nowhere}]"})
    with pytest.raises(ConfigError, match=re.escape("classes[0].match.stream (--classes)")):
        _config("--classes", "[{name: c, match: {stream: maybe}}]")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EXTPROC_WORKERS": "two"}, "EXTPROC_WORKERS: not a valid integer: 'two'"),
        ({"EXTPROC_SESSIONS__TTL_S": "long"}, "EXTPROC_SESSIONS__TTL_S: not a valid number: 'long'"),
        ({"EXTPROC_MODE": "magic"}, "EXTPROC_MODE: expected one of cluster, endpoint, got 'magic'"),
        ({"EXTPROC_SPILLOVER__REPIN": "sure"}, "EXTPROC_SPILLOVER__REPIN: not a valid boolean"),
        ({"EXTPROC_QUEUEING__DEFAULT__STATUS": "500"}, "expected one of 429, 503, got '500'"),
        ({"EXTPROC_CLASSES": "[{name: a"}, "EXTPROC_CLASSES: not valid YAML"),
        ({"EXTPROC_STORE": "mongodb://x"}, "store (EXTPROC_STORE):"),
        ({"EXTPROC_HEALTH__ENGINE_RATES": "{a: 1}"}, "health.engine_rates (EXTPROC_HEALTH__ENGINE_RATES):"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(env=env)


def test_nested_and_structured_values_from_variables(tmp_path: Path) -> None:
    cfg = _config(
        env={
            "EXTPROC_HEALTH__TOKEN_TIMING": "always",
            "EXTPROC_HEALTH__LIMITS__QUEUE_FULL": "12",
            "EXTPROC_GRPC__HEALTH_LISTEN": "0.0.0.0:9003",
            "EXTPROC_KV_EVENTS__TOKENIZERS": "{qwen: /models/qwen}",
            "EXTPROC_REPLICAS": "[{name: a, address: '10.0.0.1:8000', labels: {pool: gold}}]",
            "EXTPROC_DISCOVERY__TYPE": "inference_pool",
            "EXTPROC_DISCOVERY__NAME": "qwen",
            "EXTPROC_ADMIN__TOKEN_FILE": "null",
            "EXTPROC_STORE": "",  # empty: unset
        }
    )
    assert cfg.health.token_timing == "always" and cfg.health.limits.queue_full == 12
    assert cfg.grpc.health_listen == "0.0.0.0:9003" and cfg.kv_events.tokenizers == {"qwen": "/models/qwen"}
    assert [(r.name, dict(r.labels)) for r in cfg.replicas] == [("a", {"pool": "gold"})]
    assert cfg.discovery.type == "inference_pool" and cfg.store == "memory://"


def test_the_order_is_key_flag_then_named_flag_then_variable_then_file_then_default(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("listen: 127.0.0.1:7000\nsessions: {ttl_s: 60}\nring: {vnodes: 7}\n")
    env = {"EXTPROC_LISTEN": "127.0.0.1:7001", "EXTPROC_SESSIONS__TTL_S": "90"}
    cfg = _config(env=env, path=path)
    assert (cfg.listen, cfg.sessions.ttl_s, cfg.ring.vnodes, cfg.ring.key_blocks) == ("127.0.0.1:7001", 90, 7, 32)
    assert _config("--grpc-port", "7002", env=env, path=path).listen == "0.0.0.0:7002"
    both = _config("--listen", "127.0.0.1:7003", "--grpc-port", "7002", env=env, path=path)
    assert both.listen == "127.0.0.1:7003"
    assert _config("--sessions-ttl-s", "30", env=env, path=path).sessions.ttl_s == 30


def test_off_turns_a_served_section_off_and_an_address_on(tmp_path: Path) -> None:
    assert _config(env={"EXTPROC_METRICS__LISTEN": "off"}).metrics.address is None
    assert _config("--metrics-listen", "off").metrics.address is None
    path = tmp_path / "router.yaml"
    path.write_text("metrics: {enabled: false}\ntracing: {enabled: false}\n")
    assert _config("--metrics-listen", "127.0.0.1:1", path=path).metrics.address == "127.0.0.1:1"
    assert _config(env={"EXTPROC_TRACING__ENDPOINT": "10.0.0.9:4317"}, path=path).tracing.enabled
    assert not _config("--admin-listen", "off").admin.enabled


def test_a_variable_of_no_key_is_refused_but_not_the_labs_own() -> None:
    with pytest.raises(ConfigError, match=re.escape("EXTPROC_HEALTH__TOKEN_TIMNG: no such key of the config")):
        _config(env={"EXTPROC_HEALTH__TOKEN_TIMNG": "always"})
    message = (
        "EXTPROC_POOL_NAME: --pool-name is a flag kept by name, with no variable; its key's is EXTPROC_DISCOVERY__NAME"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(env={"EXTPROC_POOL_NAME": "qwen"})
    with pytest.raises(ConfigError, match=re.escape("EXTPROC_METRICS_LISTEN: no such variable; metrics.listen's is")):
        _config(env={"EXTPROC_METRICS_LISTEN": "0.0.0.0:9190"})  # a flag's name in capitals
    lab = {"EXTPROC_INFERENCE_PERF_PYTHON": "/usr/bin/python3", "EXTPROC_STORE_PASSWORD": "x", "EXTPROC_REPLICA": ""}
    lab |= {
        "EXTPROC_ENGINES_DIR": "/e",
        "EXTPROC_PEERS_DIR": "/p",
        "EXTPROC_TRACES_DIR": "/t",
        "EXTPROC_VLLM_PYTHON": "p",
    }
    assert _config(env=lab).store == "memory://"  # the lab's and the store's own variables; an empty one is unset


def test_the_serve_command_has_a_flag_per_key_and_the_names_users_have() -> None:
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    options = {o for action in serve._actions for o in action.option_strings}
    command = {"-h", "--help", "--config", "--log-level", "--log-format"}
    picker = {"--pool-group", "--zap-encoder", "--v", "--config-file", "--config-text", "--ha-enable-leader-election"}
    picker |= {"--tracing", "--metrics-endpoint-auth"}  # GIE's, accepted and reported (test_picker_invocation)
    assert options - command - picker == {k.flag for k in config_keys()} | {a.name for a in ALIASES}
    kept = "--listen --mode --workers --store --metrics-listen --admin-listen --admin-token-file --tracing-endpoint"
    kept += " --tracing-sampler --kv-events-listen --kv-events-port"
    assert set(kept.split()) <= {k.flag for k in config_keys()}  # names users have, now made from their keys
    # Every flag serve had before the flags were made from the model still parses.
    before = "--listen --replica --mode --pool-name --pool-namespace --workers --store --metrics-listen"
    before += " --response-sample-rate --health-listen --tls-cert --tls-key --grpc-port --grpc-health-port"
    before += " --metrics-port --cert-path --secure-serving --tls-client-ca --admin-listen --tracing-endpoint"
    before += " --tracing-sampler --admin-token-file --tokenizer --lora-adapter --kv-events-listen --kv-events-port"
    before += " --kv-replay-port --kv-hash-algo --kv-hash-seed --kv-check-sample-rate"
    assert set(before.split()) <= options
    paths = {k.path for k in config_keys()}
    for alias in ALIASES:
        assert alias.key in paths or any(p.startswith(alias.key + ".") for p in paths), alias.name
    help_text = " ".join(serve.format_help().split())
    assert all(f"env {k.env}]" in help_text for k in config_keys())


def test_named_flags_override_the_file_and_are_checked_as_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("metrics: {enabled: false}\nkv_events: {tokenizers: {a: /a}}\nsessions: {ttl_s: 60}\n")
    cfg = _config("--metrics-listen", "127.0.0.1:1", "--tokenizer", "b=/b", path=path)
    assert cfg.metrics.address == "127.0.0.1:1" and cfg.kv_events.tokenizers == {"a": "/a", "b": "/b"}
    assert cfg.sessions.ttl_s == 60
    with pytest.raises(ConfigError, match=re.escape("health.response_sample_rate (--response-sample-rate):")):
        _config("--response-sample-rate", "1.5")
    with pytest.raises(ConfigError, match=re.escape("store (--store):")):
        _config("--store", "mongodb://x")
    with pytest.raises(ConfigError, match=re.escape("--tokenizer: expected MODEL=DIR, got 'nodir'")):
        _config("--tokenizer", "nodir")
    with pytest.raises(ConfigError, match=re.escape("--tls-cert and --tls-key: both are needed")):
        _config("--tls-cert", "/c.pem")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--workers", "two"])


def test_a_replicas_per_replica_keys_are_the_replica_flags_labels() -> None:
    from extproc.config import REPLICA_KV_FIELDS, ReplicaEntry

    # Every key of a replicas: entry can be given with --replica (NAME=HOST:PORT, its labels, its
    # KV-event endpoints as labels) but its weight, which a flag's replica keeps at 1.
    assert set(ReplicaEntry.model_fields) == {"name", "address", "labels", "weight", *REPLICA_KV_FIELDS}
    flag = parse_replica("a=h:1,pool=gold,kv_events=tcp://h:2,kv_replay=tcp://h:3,kv_dp=2")
    entry = {"name": "a", "address": "h:1", "labels": {"pool": "gold"}}
    kv = {"kv_events": "tcp://h:2", "kv_replay": "tcp://h:3", "kv_dp": 2}
    assert config_from_mapping({"replicas": [{**entry, **kv}]}).replicas == (flag,)


def test_the_disaggregation_section_reaches_the_pair_and_is_checked() -> None:
    cfg = config_from_mapping({"disaggregation": {"threshold_tokens": 512, "weigh_local": False}})
    pairing = cfg.disaggregation.pair_settings(block_tokens=16)
    assert (pairing.threshold_tokens, pairing.weigh_local, pairing.block_tokens) == (512, False, 16)
    with pytest.raises(ConfigError, match=r"disaggregation\.threshold_tokens"):
        config_from_mapping({"disaggregation": {"threshold_tokens": -1}})
    with pytest.raises(ConfigError, match=r"disaggregation\.threshold: unknown key"):
        config_from_mapping({"disaggregation": {"threshold": 5}})
    assert "x-prefiller-host-port" in cfg.routing_headers  # a client never names a prefill replica


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
    assert "config error: mode: Input should be" in capsys.readouterr().err  # the file was read
    monkeypatch.setenv("EXTPROC_MODE", "endpoint")
    monkeypatch.setenv("EXTPROC_WORKERS", "0")
    assert main(["serve"]) == 2
    assert "config error: workers (EXTPROC_WORKERS): Input should be greater" in capsys.readouterr().err
    monkeypatch.setenv("EXTPROC_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        main(["serve"])
    assert "EXTPROC_LOG_FORMAT: expected one of text, json, got 'xml'" in capsys.readouterr().err


def test_gies_picker_flags_mean_the_same_here_and_errors_name_the_flag_given(tmp_path: Path) -> None:
    argv = "--pool-name vllm --pool-namespace llm --grpc-port 9002 --grpc-health-port 9003 --metrics-port 9090"
    cfg = _config(*argv.split(), "--cert-path", "/etc/certs/")
    assert (cfg.listen, cfg.grpc.health_listen, cfg.metrics.address) == ("0.0.0.0:9002", "0.0.0.0:9003", "0.0.0.0:9090")
    assert cfg.grpc.tls is not None
    assert (cfg.grpc.tls.cert_file, cfg.grpc.tls.key_file) == ("/etc/certs/tls.crt", "/etc/certs/tls.key")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--grpc-port", "70000"])
    # An error about a key names the flag or variable that set it, a key matched whole, and none
    # where the file set it.
    bad = tmp_path / "router.yaml"
    bad.write_text("metrics: {listen: [1]}\n")
    with pytest.raises(ConfigError) as raised:
        _config("--listen", "127.0.0.1:1", path=bad)
    assert "metrics.listen: Input should be" in str(raised.value)
    bad.write_text("listen: 127.0.0.1:1\n")
    with pytest.raises(ConfigError, match=re.escape("kv_events.check_sample_rate (--kv-check-sample-rate):")):
        _config("--kv-check-sample-rate", "2", path=bad)


def test_the_grpclib_server_asks_for_the_admin_api_on_a_port_of_its_own() -> None:
    with pytest.raises(
        ConfigError, match="grpclib serves ext_proc and health only; give the admin API a port of its own"
    ):
        _config("--grpc-server", "grpclib")
    with pytest.raises(ConfigError, match="grpclib serves ext_proc and health only"):
        _config("--grpc-server", "grpclib", "--admin-listen", "127.0.0.1:9002")  # the ext_proc port itself
    assert _config("--grpc-server", "grpclib", "--admin-listen", "off").grpc.server == "grpclib"
    assert _config("--grpc-server", "grpclib", "--admin-listen", "127.0.0.1:9003").admin.listen == "127.0.0.1:9003"
    assert _config().grpc.server == "grpcio"
