"""Opening the affinity store a URL names: ``memory://`` (the embedded default) or Redis."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from extproc.state.memory import MemoryStore
from extproc.state.store import AffinityStore, StoreObserver
from extproc.state.store_url import parse_store_url

log = logging.getLogger("extproc.state")

DEFAULT_NAMESPACE = "default"


def open_store(
    url: str,
    ttl_s: float = 600.0,
    max_sessions: int = 100_000,
    blocks_per_replica: int = 31_250,
    namespace: str | None = None,
    observer: StoreObserver | None = None,
    env: Mapping[str, str] | None = None,
) -> AffinityStore:
    """The store for ``url`` (see :mod:`extproc.state.store_url` for the forms and options).

    No connection is made here: a Redis that is down at start-up only means the gateway routes
    on local state until it comes up. ``namespace`` (else the URL's ``namespace`` option, else
    ``default``) separates deployments sharing one Redis. Raises ValueError for a bad URL.
    """
    parsed = parse_store_url(url)
    if parsed.kind == "memory":
        return MemoryStore(ttl_s, max_sessions, blocks_per_replica)
    from extproc.state.redis_client import DEFAULT_TIMEOUT_S, connect
    from extproc.state.redis_store import RedisStore

    ns = namespace or str(parsed.options.get("namespace") or DEFAULT_NAMESPACE)
    prefix_ttl = parsed.options.get("prefix_ttl")
    store = RedisStore(
        connect(parsed, env),
        namespace=ns,
        ttl_s=ttl_s,
        max_sessions=max_sessions,
        blocks_per_replica=blocks_per_replica,
        prefix_ttl_s=float(prefix_ttl) if isinstance(prefix_ttl, (int, float)) and prefix_ttl > 0 else None,
        near_cache_ttl_s=parsed.option("near_cache_ttl", 1.0),
        near_cache_size=int(parsed.option("near_cache_size", 10_000)),
        timeout_s=parsed.option("socket_timeout", DEFAULT_TIMEOUT_S),
        backlog=max(1, int(parsed.option("backlog", 10_000))),
        observer=observer,
        name=parsed.redacted,
    )
    log.info("affinity store %s (namespace %s)", parsed.redacted, ns)
    if parsed.password is not None:
        # It works, but a URL ends up in config files, process listings and shell history.
        log.warning("the store URL carries its password inline; prefer password_file= or password_env=")
    return store
