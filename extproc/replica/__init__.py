"""A fake vLLM replica for demos, end-to-end tests and capacity planning.

It speaks vLLM's OpenAI-compatible API (chat and completions, streaming or not), keeps a prefix
cache of KV blocks hashed like the router's, makes cache hits show as a faster first token,
serialises prefills so overload shows as queueing, and exposes vLLM's ``/metrics`` names.

Run one with ``await serve_replica("replica-0", "127.0.0.1", 8001)``; embed one with
``build_app(ReplicaEngine(PROFILES["demo"]), "replica-0", "demo-model")``.
"""

from extproc.replica.cache import CHARS_PER_TOKEN, PrefixCache, count_tokens
from extproc.replica.engine import Generation, ReplicaEngine, output_budget
from extproc.replica.http import REPLICA_HEADER, build_app, serve_replica
from extproc.replica.timing import PROFILES, ReplicaProfile, get_profile

__all__ = [
    "CHARS_PER_TOKEN",
    "PROFILES",
    "REPLICA_HEADER",
    "Generation",
    "PrefixCache",
    "ReplicaEngine",
    "ReplicaProfile",
    "build_app",
    "count_tokens",
    "get_profile",
    "output_budget",
    "serve_replica",
]
