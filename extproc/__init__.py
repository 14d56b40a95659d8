"""KV-cache aware routing for vLLM fleets behind Envoy, as an ext_proc gRPC server.

The package's own names: :class:`Router` (features -> store view -> pure decision -> bookkeeping),
:func:`decide` and the plugin pipeline, the affinity stores, :class:`Config`, and ``__version__``.
The whole public surface is :mod:`extproc.api` (and :mod:`extproc.api.sim` for simulating the router);
the lab, fuzzers and benchmarks import from those alone.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from extproc.app.router import Routed, Router
from extproc.config import Config, ConfigError, load_config
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
try:
    # The one place the version is written is pyproject.toml; the installed metadata carries it.
    __version__ = _version("extproc-router")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
