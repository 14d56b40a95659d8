"""Affinity store URLs: which store, where it lives, and how to reach it, parsed without connecting.

Forms (``rediss`` instead of ``redis`` means TLS in every form)::

    memory://                                          the embedded store (one gateway)
    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]         one Redis server
    unix://[[USER]:PASSWORD@]/PATH/TO/redis.sock[?db=N] one Redis server on a unix socket
    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]
                                                       the master Sentinel names SERVICE
    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]
                                                       a Redis Cluster, from any of its nodes

Query options (all optional): ``namespace`` (the deployment's key namespace), ``socket_timeout``
and ``connect_timeout`` (seconds, default 0.05: far below Envoy's message timeout),
``near_cache_ttl`` (seconds, 0 disables the near-cache), ``near_cache_size``, ``prefix_ttl``
(seconds, default the session TTL), ``backlog`` (writes held while Redis is away),
``max_connections``, ``password_file``, ``password_env``, ``sentinel_password_env``,
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (required, optional, none),
``ssl_check_hostname``.

Secrets: a password in the URL works but ends up in process listings and config files; prefer
``password_file=/run/secrets/redis`` or ``password_env=NAME`` (or ``EXTPROC_STORE_PASSWORD``,
read when nothing else names a password). :attr:`StoreURL.redacted` is the only form ever logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

StoreKind = Literal["memory", "redis", "sentinel", "cluster"]
PASSWORD_ENV = "EXTPROC_STORE_PASSWORD"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379

_SCHEMES: dict[str, tuple[StoreKind, bool]] = {
    "memory": ("memory", False),
    "redis": ("redis", False),
    "rediss": ("redis", True),
    "unix": ("redis", False),
    "redis+unix": ("redis", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
_FLOAT_OPTIONS = {"socket_timeout", "connect_timeout", "near_cache_ttl", "prefix_ttl"}
_INT_OPTIONS = {"near_cache_size", "backlog", "max_connections", "db"}
_BOOL_OPTIONS = {"ssl_check_hostname"}
_STR_OPTIONS = {
    "namespace",
    "password_file",
    "password_env",
    "sentinel_password_env",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
}
KNOWN_OPTIONS = _FLOAT_OPTIONS | _INT_OPTIONS | _BOOL_OPTIONS | _STR_OPTIONS


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL. ``password`` never appears in ``repr`` or logs."""

    kind: StoreKind
    tls: bool = False
    hosts: tuple[tuple[str, int], ...] = ()
    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service_name: str | None = None
    options: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    redacted: str = ""

    def option(self, name: str, default: float) -> float:
        """A numeric option, or ``default``."""
        value = self.options.get(name, default)
        return float(value) if not isinstance(value, str) else default

    def resolve_password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The password: from the URL, else ``password_file``, else ``password_env``, else
        ``EXTPROC_STORE_PASSWORD``; None when none is set."""
        if self.password is not None:
            return self.password
        env = os.environ if env is None else env
        path = self.options.get("password_file")
        if isinstance(path, str):
            try:
                return Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(f"password_file {path}: {exc.strerror}") from None
        name = self.options.get("password_env")
        if isinstance(name, str):
            if name not in env:
                raise ValueError(f"password_env: environment variable {name} is not set")
            return env[name]
        return env.get(PASSWORD_ENV)

    def sentinel_password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The password of the Sentinels themselves (``sentinel_password_env``), if any."""
        name = self.options.get("sentinel_password_env")
        if not isinstance(name, str):
            return None
        env = os.environ if env is None else env
        return env.get(name)


def _redact(url: str, has_password: bool) -> str:
    if not has_password:
        return url
    scheme, _, rest = url.partition("://")
    userinfo, _, hostpart = rest.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{hostpart}"


def _hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts = []
    for raw in netloc.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("["):  # [ipv6]:port
            host, _, port = item[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise ValueError(f"missing host in {item!r}")
        if port and (not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"bad port in {item!r}")
        hosts.append((host, int(port) if port else default_port))
    return tuple(hosts)


def _options(query: str) -> dict[str, str | int | float | bool]:
    out: dict[str, str | int | float | bool] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in KNOWN_OPTIONS:
            raise ValueError(f"unknown option {name!r} (known: {', '.join(sorted(KNOWN_OPTIONS))})")
        value = values[-1]
        try:
            if name in _FLOAT_OPTIONS:
                number = float(value)
                if number < 0:
                    raise ValueError
                out[name] = number
            elif name in _INT_OPTIONS:
                integer = int(value)
                if integer < 0:
                    raise ValueError
                out[name] = integer
            elif name in _BOOL_OPTIONS:
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                out[name] = value.lower() in ("1", "true", "yes")
            else:
                out[name] = value
        except ValueError:
            raise ValueError(f"option {name}: bad value {value!r}") from None
    reqs = out.get("ssl_cert_reqs")
    if reqs is not None and reqs not in ("required", "optional", "none"):
        raise ValueError(f"option ssl_cert_reqs: expected required, optional or none, got {reqs!r}")
    return out


def parse_store_url(url: str) -> StoreURL:
    """Parse and check a store URL; raises ValueError with a message that never shows a password."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        shown = url.split("://", 1)[0] + "://" if sep else url[:40]
        raise ValueError(f"unsupported store URL {shown!r}: expected one of {', '.join(s + '://' for s in _SCHEMES)}")
    kind, tls = _SCHEMES[scheme.lower()]
    if kind == "memory":
        return StoreURL(kind="memory", redacted="memory://")
    # urlsplit wants one host; several (Sentinel, Cluster seeds) are split out by hand.
    parts = urlsplit(f"redis://{rest}")
    netloc = parts.netloc
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    redacted = _redact(url, password is not None)
    try:
        options = _options(parts.query)
        path = unquote(parts.path)
        db = int(options.pop("db", 0))
        service_name = None
        unix_path = None
        hosts: tuple[tuple[str, int], ...] = ()
        if scheme.lower() in ("unix", "redis+unix"):
            if hostlist or not path:
                raise ValueError("expected unix:///absolute/path/to/redis.sock")
            unix_path = path
        elif kind == "sentinel":
            hosts = _hosts(hostlist, DEFAULT_SENTINEL_PORT)
            segments = [s for s in path.split("/") if s]
            if not segments or len(segments) > 2:
                raise ValueError("expected redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE_NAME[/DB]")
            service_name = segments[0]
            if len(segments) == 2:
                db = _db(segments[1])
        else:
            hosts = _hosts(hostlist, DEFAULT_PORT)
            segments = [s for s in path.split("/") if s]
            if kind == "cluster" and segments:
                raise ValueError("a Redis Cluster has no database number")
            if len(segments) > 1:
                raise ValueError("expected at most one path segment, the database number")
            if segments:
                db = _db(segments[0])
            if kind == "redis" and len(hosts) != 1:
                raise ValueError("expected one HOST[:PORT] (several hosts need redis+sentinel or redis+cluster)")
        if kind in ("sentinel", "cluster") and not hosts:
            raise ValueError("expected at least one HOST:PORT")
    except ValueError as exc:
        raise ValueError(f"store URL {redacted}: {exc}") from None
    return StoreURL(
        kind=kind,
        tls=tls,
        hosts=hosts,
        unix_path=unix_path,
        db=db,
        username=username,
        password=password,
        service_name=service_name,
        options=options,
        redacted=redacted,
    )


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"bad database number {text!r}")
    return int(text)
