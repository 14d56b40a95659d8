"""What is kept and shared: the affinity stores (the protocol, the in-memory store, the Redis
store in :mod:`extproc.state.redis_store`, and :func:`open_store` for a ``memory://`` or Redis
URL), token budgets (:mod:`.budgets`), tenants (:mod:`.tenancy`) and the usage metered by
tenant (:mod:`.metering`)."""

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
