"""A vLLM replica: a pure model of its KV cache and scheduler, and a fake server built on it.

:class:`ReplicaModel` is the replica as the router sees it from outside: a prefix cache of KV
blocks with LRU eviction, continuous batching within a token budget, a waiting queue, preemption
when blocks run out, and vLLM's gauges, counters and latency histograms. It has no I/O and no
clock. Two drivers step it: :class:`ReplicaEngine` with the HTTP server of :mod:`.http` (vLLM's
OpenAI-compatible API and ``/metrics``, in real or scaled time) and the simulator of
:mod:`extproc_lab.sim` (a virtual clock).

Run one server with ``await serve_replica("replica-0", "127.0.0.1", 8001)``; embed one with
``build_app(ReplicaEngine(PROFILES["demo"]), "replica-0", "demo-model")``.
"""

from extproc_lab.replica.cache import PrefixCache, WeightedPrefixCache, count_tokens
from extproc_lab.replica.engine import Generation, ReplicaEngine, filler_text, filler_token, output_budget
from extproc_lab.replica.http import REPLICA_HEADER, build_app, serve_replica
from extproc_lab.replica.model import KVPool, ReplicaModel, Seq, StepResult
from extproc_lab.replica.timing import PROFILES, ReplicaProfile, get_profile

__all__ = [
    "PROFILES",
    "REPLICA_HEADER",
    "Generation",
    "KVPool",
    "PrefixCache",
    "ReplicaEngine",
    "ReplicaModel",
    "ReplicaProfile",
    "Seq",
    "StepResult",
    "WeightedPrefixCache",
    "build_app",
    "count_tokens",
    "filler_text",
    "filler_token",
    "get_profile",
    "output_budget",
    "serve_replica",
]
