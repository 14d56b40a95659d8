"""KV-cache aware routing for vLLM fleets behind Envoy, as an ext_proc gRPC server.

The public API: :class:`Router` (features -> store view -> pure decision -> bookkeeping),
:func:`decide` and the plugin pipeline, the affinity stores, and :class:`Config`.
"""

from extproc.config import Config, ConfigError, load_config
from extproc.router import Routed, Router
from extproc.routing import AffinityView, Decision, Reason, Replica, ReplicaState, Snapshot, decide
from extproc.state import AffinityStore, MemoryStore

__all__ = [
    "AffinityStore",
    "AffinityView",
    "Config",
    "ConfigError",
    "Decision",
    "MemoryStore",
    "Reason",
    "Replica",
    "ReplicaState",
    "Routed",
    "Router",
    "Snapshot",
    "decide",
    "load_config",
]
__version__ = "0.1.0"
