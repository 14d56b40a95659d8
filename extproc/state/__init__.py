"""Affinity state: the store protocol and its in-memory implementation."""

from extproc.state.memory import MemoryStore, PrefixIndex, SessionMap
from extproc.state.store import AffinityStore, StoreStats

__all__ = ["AffinityStore", "MemoryStore", "PrefixIndex", "SessionMap", "StoreStats"]
