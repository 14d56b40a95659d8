"""The router's public surface, for anyone who embeds, benchmarks or fuzzes it.

Everything the lab, the fuzzers and the benchmarks import from the router comes from here or
from :mod:`extproc.api.sim` (the simulator's and the fake replica's extras);
``tests/project/test_layers.py`` holds them to that. The names below are re-exports: where they
are defined is the router's own business. **A name that is not in this module's ``__all__`` (or
in :mod:`extproc.api.sim`'s) is private and may move or change without notice**, including every
``extproc.<module>`` path.

What is here:

- configuration: :class:`Config` and its sections, :func:`load_config`, :func:`config_from_mapping`,
  :func:`with_overrides`, and the ``extproc`` command itself (:func:`cli_main`);
- the request path in process: :class:`Router` (and what it returns, :class:`Routed`),
  :class:`Planner` and :class:`RequestStream` (what the gRPC server wraps);
- the decision: :func:`decide`, its inputs and outputs, the profiles of filters, scorers and a
  picker (:func:`build_profile`, the plugin :data:`REGISTRY`), the trace;
- the affinity stores: memory, Redis (and the Redis store's key layout and record script, for
  measuring its memory);
- replicas and their health as the scraper reads them, request features, tenants, upstream
  timeouts, the Envoy configuration a gateway is rendered from;
- the admin API's messages and gRPC stub (``admin_pb2``, ``admin_pb2_grpc``), for a client of a
  running router;
- the wire formats the router reads: OpenAI bodies, the usage a response reports, vLLM's KV-event
  batches (and the KV-event subscriber, index and cache state built on them).
"""

import importlib
from typing import TYPE_CHECKING, Any

from extproc.adapters.cli import main as cli_main
from extproc.app.plan import Planner
from extproc.app.router import Routed, Router
from extproc.base.upstream_timeouts import UpstreamTimeouts
from extproc.config import (
    Config,
    ConfigError,
    Disaggregation,
    Metrics,
    Prefix,
    Sessions,
    config_from_mapping,
    load_config,
    with_overrides,
)
from extproc.fleet.health.replicas import LoadReport
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.health.vllm_metrics import ReplicaMetrics, parse_vllm_metrics
from extproc.fleet.kvevents.feed import KvEventSource
from extproc.fleet.kvevents.index import ModelIndex
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.kvevents.subscriber import Subscriptions
from extproc.fleet.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    WireError,
    decode_batch,
    encode_batch,
    split_message,
)
from extproc.fleet.queueing import QueueClass, QueueSettings
from extproc.fleet.rebalance.prewarm import PrewarmSettings
from extproc.fleet.rebalance.rebalancer import RebalanceSettings
from extproc.observe.metrics.kv_events import KvEventMetrics
from extproc.request.agent_apis import answer_messages
from extproc.request.agent_hints import MAX_DEMOTION
from extproc.request.features import (
    CHARS_PER_TOKEN,
    FeatureSettings,
    RequestFeatures,
    extract_features,
    read_request,
)
from extproc.request.openai_body import CHAT_PATH, COMPLETIONS_PATH, BodyError, parse_request_body, render_chat
from extproc.request.tokenizer import PromptTokenizer, TokenizerError, TokenizerRegistry
from extproc.request.usage import UsageTail, parse_usage
from extproc.routing.disagg import PairSettings
from extproc.routing.model import AffinityView, Decision, Reason, Replica, ReplicaState, Snapshot, cache_fill
from extproc.routing.pipeline import DecisionInputs, Profile, decide
from extproc.routing.plugins import CycleState
from extproc.routing.registry import (
    DEFAULT_PROFILE,
    PRICE_PROFILE,
    REGISTRY,
    SCORES_PROFILE,
    ProfileError,
    build_profile,
)
from extproc.routing.roles import ROLE_LABEL, Role
from extproc.routing.trace import DecisionTrace
from extproc.state import AffinityStore
from extproc.state.memory import MemoryStore
from extproc.state.tenancy import TenantPolicy, TenantSettings

if TYPE_CHECKING:
    from extproc._proto.admin.v1 import admin_pb2, admin_pb2_grpc
    from extproc.adapters.envoy_config import GatewaySpec, render_yaml
    from extproc.adapters.server.stream import RequestStream
    from extproc.fleet.kvevents.cache_state import EventCacheState
    from extproc.state.factory import open_store
    from extproc.state.redis_keys import KeySpace
    from extproc.state.redis_scripts import RECORD, pack_hashes
    from extproc.state.redis_store import RedisStore

# Imported on first use: these cost a simulator or a fake replica most of its start-up (the Envoy
# data-plane types alone most of a second, the gRPC server and the Redis client the rest) and
# neither uses them. The names are the TYPE_CHECKING imports above, for the type checker.
_LAZY = {
    "GatewaySpec": "extproc.adapters.envoy_config",
    "render_yaml": "extproc.adapters.envoy_config",
    "EventCacheState": "extproc.fleet.kvevents.cache_state",
    "RequestStream": "extproc.adapters.server.stream",
    "open_store": "extproc.state.factory",
    "KeySpace": "extproc.state.redis_keys",
    "RECORD": "extproc.state.redis_scripts",
    "pack_hashes": "extproc.state.redis_scripts",
    "RedisStore": "extproc.state.redis_store",
}
# The admin API's messages and stub, for a client of a running router.
_LAZY_MODULES = {
    "admin_pb2": "extproc._proto.admin.v1.admin_pb2",
    "admin_pb2_grpc": "extproc._proto.admin.v1.admin_pb2_grpc",
}

__all__ = [
    "CHARS_PER_TOKEN",
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DEFAULT_PROFILE",
    "MAX_DEMOTION",
    "PRICE_PROFILE",
    "RECORD",
    "REGISTRY",
    "ROLE_LABEL",
    "SCORES_PROFILE",
    "AffinityStore",
    "AffinityView",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BodyError",
    "Config",
    "ConfigError",
    "CycleState",
    "Decision",
    "DecisionInputs",
    "DecisionTrace",
    "Disaggregation",
    "Event",
    "EventCacheState",
    "FeatureSettings",
    "GatewaySpec",
    "HealthSettings",
    "KeySpace",
    "KvEventMetrics",
    "KvEventSettings",
    "KvEventSource",
    "LoadReport",
    "MemoryStore",
    "Metrics",
    "ModelIndex",
    "PairSettings",
    "Planner",
    "Prefix",
    "PrewarmSettings",
    "Profile",
    "ProfileError",
    "PromptTokenizer",
    "QueueClass",
    "QueueSettings",
    "Reason",
    "RebalanceSettings",
    "RedisStore",
    "Replica",
    "ReplicaMetrics",
    "ReplicaState",
    "RequestFeatures",
    "RequestStream",
    "Role",
    "Routed",
    "Router",
    "Sessions",
    "Snapshot",
    "Subscriptions",
    "TenantPolicy",
    "TenantSettings",
    "TokenizerError",
    "TokenizerRegistry",
    "UpstreamTimeouts",
    "UsageTail",
    "WireError",
    "admin_pb2",
    "admin_pb2_grpc",
    "answer_messages",
    "build_profile",
    "cache_fill",
    "cli_main",
    "config_from_mapping",
    "decide",
    "decode_batch",
    "encode_batch",
    "extract_features",
    "load_config",
    "open_store",
    "pack_hashes",
    "parse_request_body",
    "parse_usage",
    "parse_vllm_metrics",
    "read_request",
    "render_chat",
    "render_yaml",
    "split_message",
    "with_overrides",
]


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY` and :data:`_LAZY_MODULES`, imported on first use."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
