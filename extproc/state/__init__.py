"""Affinity state: the store protocol, the in-memory store, and :func:`open_store` for a URL
(``memory://`` or Redis; the Redis store lives in :mod:`extproc.state.redis_store`)."""

from extproc.state.factory import open_store
from extproc.state.memory import MemoryStore, PrefixIndex, SessionMap
from extproc.state.store import AffinityStore, NullStoreObserver, StoreObserver, StoreStats

__all__ = [
    "AffinityStore",
    "MemoryStore",
    "NullStoreObserver",
    "PrefixIndex",
    "SessionMap",
    "StoreObserver",
    "StoreStats",
    "open_store",
]
