"""redis.asyncio clients for a :class:`~extproc.state.store_url.StoreURL`: one server (TCP, TLS or
unix socket), the master behind Sentinel, or a Cluster.

Every client fails fast: short socket and connect timeouts and no retries inside redis-py. The
store decides what a failure means (route on local state, probe with backoff); a client that
retried three times with backoff on its own would hold a request for that long instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from extproc.state.store_url import StoreURL

RedisClient = Redis | RedisCluster

DEFAULT_TIMEOUT_S = 0.05
DEFAULT_MAX_CONNECTIONS = 64

# What a lost or slow Redis raises (redis-py's ConnectionError and TimeoutError are RedisErrors;
# the rest come from sockets and from asyncio.timeout).
UNAVAILABLE = (RedisError, OSError, TimeoutError)

T = TypeVar("T")


def as_awaitable(reply: Awaitable[T] | T) -> Awaitable[T]:
    """An async client's command, typed as what it is: redis-py types some commands for its sync
    and async clients at once (``Awaitable[X] | X``), depending on its version."""
    return cast("Awaitable[T]", reply)


def _common(url: StoreURL, env: Mapping[str, str] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": url.option("socket_timeout", DEFAULT_TIMEOUT_S),
        "socket_connect_timeout": url.option("connect_timeout", DEFAULT_TIMEOUT_S),
        "retry": Retry(NoBackoff(), 0),
        "username": url.username,
        "password": url.resolve_password(env),
    }
    if url.tls:
        kwargs["ssl"] = True
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"):
            if name in url.options:
                kwargs[name] = url.options[name]
    return kwargs


def connect(url: StoreURL, env: Mapping[str, str] | None = None) -> RedisClient:
    """A client for ``url`` (no I/O yet: connections open on first use)."""
    if url.kind == "memory":
        raise ValueError("memory:// needs no Redis client")
    kwargs = _common(url, env)
    max_connections = int(url.option("max_connections", DEFAULT_MAX_CONNECTIONS))
    if url.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in url.hosts],
            max_connections=max_connections,
            **kwargs,
        )
    if url.kind == "sentinel":
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": kwargs["socket_timeout"],
            "socket_connect_timeout": kwargs["socket_connect_timeout"],
            "retry": Retry(NoBackoff(), 0),
        }
        secret = url.sentinel_password(env)
        if secret is not None:
            sentinel_kwargs["password"] = secret
        if url.tls:
            sentinel_kwargs.update({k: v for k, v in kwargs.items() if k.startswith("ssl")})
        sentinel = Sentinel(list(url.hosts), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        client: Redis = sentinel.master_for(
            url.service_name or "mymaster", db=url.db, max_connections=max_connections, **kwargs
        )
        return client
    if url.unix_path is not None:
        return Redis(unix_socket_path=url.unix_path, db=url.db, max_connections=max_connections, **kwargs)
    host, port = url.hosts[0]
    return Redis(host=host, port=port, db=url.db, max_connections=max_connections, **kwargs)
