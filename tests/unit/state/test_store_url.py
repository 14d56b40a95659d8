"""Store URLs: every form parses to what it says, mistakes are named, passwords never shown."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc.adapters.cli import main
from extproc.config import ConfigError, config_from_mapping
from extproc.config.cli_flags import add_config_flags, config_from_flags
from extproc.state import MemoryStore
from extproc.state.factory import open_store
from extproc.state.redis_store import RedisStore
from extproc.state.store_url import PASSWORD_ENV, parse_store_url


def test_memory() -> None:
    assert parse_store_url("memory://").kind == "memory"
    assert isinstance(open_store("memory://", ttl_s=5), MemoryStore)


def test_one_server_over_tcp_and_tls() -> None:
    url = parse_store_url("redis://10.0.0.5:6380/2?socket_timeout=0.02&near_cache_ttl=0.5")
    assert (url.kind, url.tls, url.hosts, url.db) == ("redis", False, (("10.0.0.5", 6380),), 2)
    assert url.option("socket_timeout", 1) == 0.02 and url.option("near_cache_ttl", 1) == 0.5
    tls = parse_store_url("rediss://cache.internal?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required")
    assert tls.tls and tls.hosts == (("cache.internal", 6379),) and tls.options["ssl_ca_certs"] == "/etc/ca.pem"
    assert parse_store_url("redis://[::1]:7000").hosts == (("::1", 7000),)


def test_unix_socket() -> None:
    url = parse_store_url("unix:///run/redis/redis.sock?db=3")
    assert url.unix_path == "/run/redis/redis.sock" and url.db == 3 and not url.hosts
    with_password = parse_store_url("unix://:pw@/run/redis.sock")
    assert with_password.unix_path == "/run/redis.sock" and with_password.password == "pw"


def test_sentinel_and_cluster() -> None:
    sentinel = parse_store_url("rediss+sentinel://user:pw@s1:26379,s2,s3:26380/mymaster/1")
    assert sentinel.kind == "sentinel" and sentinel.tls and sentinel.service_name == "mymaster"
    assert sentinel.hosts == (("s1", 26379), ("s2", 26379), ("s3", 26380)) and sentinel.db == 1
    assert sentinel.username == "user" and sentinel.password == "pw"
    cluster = parse_store_url("redis+cluster://n1:7000,n2:7001")
    assert cluster.kind == "cluster" and cluster.hosts == (("n1", 7000), ("n2", 7001))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mongodb://x", "unsupported store URL"),
        ("redis", "unsupported store URL"),
        ("redis://a:1,b:2", "one HOST"),
        ("redis://host:99999", "bad port"),
        ("redis://host/notadb", "bad database"),
        ("redis+sentinel://s1:26379", "SERVICE_NAME"),
        ("redis+cluster://n1:7000/2", "no database"),
        ("redis+cluster:///", "at least one HOST"),
        ("unix://host/path.sock", "unix:///"),
        ("redis://h?socket_timout=1", "unknown option 'socket_timout'"),
        ("redis://h?socket_timeout=soon", "option socket_timeout"),
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
    ],
)
def test_mistakes_are_named(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_store_url(url)


def test_passwords_never_appear_in_messages_or_reprs() -> None:
    url = parse_store_url("redis://admin:hunter2@h:6379")
    assert url.redacted == "redis://admin:***@h:6379" and "hunter2" not in repr(url)
    with pytest.raises(ValueError) as err:
        parse_store_url("redis://admin:hunter2@h:6379?bogus=1")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError) as cerr:
        config_from_mapping({"store": "redis://:hunter2@a:1,b:2"})
    assert "hunter2" not in str(cerr.value) and "store" in str(cerr.value)


def test_password_sources(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert parse_store_url(f"redis://h?password_file={secret}").resolve_password({}) == "from-file"
    assert parse_store_url("redis://h?password_env=MY_PW").resolve_password({"MY_PW": "from-env"}) == "from-env"
    assert parse_store_url("redis://h").resolve_password({PASSWORD_ENV: "default-env"}) == "default-env"
    assert parse_store_url("redis://:in-url@h").resolve_password({PASSWORD_ENV: "x"}) == "in-url"
    assert parse_store_url("redis://h").resolve_password({}) is None
    with pytest.raises(ValueError, match="MISSING"):
        parse_store_url("redis://h?password_env=MISSING").resolve_password({})


async def test_the_factory_opens_redis_without_connecting() -> None:
    store = open_store("redis://127.0.0.1:1?namespace=east&near_cache_ttl=0.2", ttl_s=30)
    assert isinstance(store, RedisStore)
    assert store.keys.namespace == "east" and store.near.ttl_s == 0.2 and store.ttl_ms == 30_000
    named = open_store("redis://127.0.0.1:1?namespace=east", namespace="west")
    assert isinstance(named, RedisStore) and named.keys.namespace == "west"
    await store.close()
    await named.close()


def test_config_and_command_line_accept_every_supported_store() -> None:
    for url in ("memory://", "redis://r:6379", "rediss://r", "unix:///tmp/r.sock", "redis+cluster://r:7000"):
        assert config_from_mapping({"store": url}).store == url
    cfg = config_from_mapping({"store": "redis+sentinel://s:26379/mymaster"})
    assert cfg.store.startswith("redis+sentinel://")

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--replica", "a=127.0.0.1:1", "--store", "redis://127.0.0.1:6379"])
    assert config_from_flags(None, args).store == "redis://127.0.0.1:6379"


def test_serve_rejects_a_bad_store_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replica", "a=127.0.0.1:1", "--store", "mongodb://x"]) == 2
    assert "store" in capsys.readouterr().err
