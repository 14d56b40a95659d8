"""The router's YAML file as a typed schema: every section, key, type and range in one place.

Validated with pydantic at start-up: unknown keys are rejected in every section, types are strict
(``"high"`` is not a number, ``true`` is not an integer) and ranges are checked, and an error
names the full path of the field (``health.limits.queue_full``). ``examples/router.yaml`` is
generated from these classes (:func:`example_yaml`; a test keeps the two equal), so the schema,
the defaults and the documented example cannot drift apart. :mod:`extproc.config` turns a
validated file into the runtime :class:`~extproc.config.Config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from extproc.health.rotation import RotationPolicy
from extproc.health.score import HealthLimits, HealthWeights
from extproc.health.settings import HealthSettings
from extproc.hotkeys.detector import HotKeySettings
from extproc.kvevents.settings import KvEventSettings
from extproc.queueing.settings import QueueClass, QueueSettings
from extproc.rebalance.prewarm import PrewarmSettings
from extproc.rebalance.rebalancer import RebalanceSettings
from extproc.request.features import FeatureSettings
from extproc.routing.registry import DEFAULT_PROFILE, REGISTRY
from extproc.tenancy import TenantPolicy, TenantSettings
from extproc.upstream_timeouts import UpstreamTimeouts
from extproc.validation import describe

_HEALTH, _WEIGHTS, _LIMITS, _ROTATION = HealthSettings(), HealthWeights(), HealthLimits(), RotationPolicy()
_REBALANCE, _PREWARM, _TENANTS, _TENANT = RebalanceSettings(), PrewarmSettings(), TenantSettings(), TenantPolicy()
_FEATURES, _UPSTREAM = FeatureSettings(), UpstreamTimeouts()
_QUEUEING, _QUEUE_CLASS = QueueSettings(), QueueClass()
_KV = KvEventSettings()
_HOT = HotKeySettings()


class Section(BaseModel):
    """A mapping of the file: unknown keys are errors, types strict, the object immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _doc(default: Any, doc: str, **checks: Any) -> Any:
    return Field(default, description=doc, **checks)


class Headers(Section):
    """``headers:``: the names of the routing headers the processor sets (and strips from clients)."""

    target_cluster: str = _doc("x-target-cluster", "cluster mode: the header a route's cluster_header reads")
    destination_endpoint: str = _doc(
        "x-gateway-destination-endpoint", "endpoint mode: the GIE endpoint-picker header (ip:port)"
    )


class ReplicaEntry(Section):
    """One item of ``replicas:``."""

    name: str = Field(description="in cluster mode, the replica's Envoy cluster")
    address: str = Field(description="HOST:PORT of its OpenAI server (and /metrics)")
    weight: float = _doc(1.0, "share of the ring, e.g. 2 for twice the GPUs", gt=0)
    labels: dict[str, str] = _doc({}, "labels pools and classes select on")
    kv_events: str | None = _doc(
        None,
        "its engines' KV-event publisher (vLLM --kv-events-config endpoint, tcp://HOST:PORT)",
        pattern=r"^[a-z]+://.",
    )
    kv_replay: str | None = _doc(None, "its engines' replay endpoint (replay_endpoint)", pattern=r"^[a-z]+://.")
    kv_dp: int | None = _doc(
        None, "engines behind it (--data-parallel-size; default kv_events.data_parallel_size)", ge=1
    )


class Sessions(Section):
    """``sessions:``."""

    ttl_s: float = _doc(600.0, "a session's pin expires this long after its last turn (sliding)", gt=0)
    max_sessions: int = _doc(100_000, "pins kept at most (LRU)", ge=1)


class Request(Section):
    """``request:``: how a request's session and tenant are found."""

    session_sources: list[str] = _doc(
        [f"{s.kind}:{s.name}" for s in _FEATURES.session_sources],
        "where the session key is read, first found wins (header:, cookie:, body: dotted path)",
    )
    max_body_bytes: int = _doc(
        _FEATURES.max_body_bytes, "larger bodies are routed on the session key without parsing", ge=1
    )


class Prefix(Section):
    """``prefix:``: prefix block hashing and the prefix index."""

    block_chars: int = _doc(_FEATURES.block_chars, "characters per block: 16 tokens x ~4 characters, as GIE", ge=1)
    max_blocks: int = _doc(_FEATURES.max_blocks, "blocks hashed at most (the first 128 KB of a prompt)", ge=1)
    blocks_per_replica: int = _doc(31_250, "prefix index entries kept per replica", ge=1)


class Ring(Section):
    """``ring:``: the consistent-hash ring that places new sessions on an idle fleet."""

    vnodes: int = _doc(128, "virtual nodes per replica (times its weight)", ge=1)
    key_blocks: int = _doc(32, "a request without a session is hashed on its first blocks (2 KB)", ge=1)


class Metrics(Section):
    """``metrics:``: Prometheus exposition."""

    enabled: bool = _doc(True, "serve /metrics")
    listen: str = _doc("127.0.0.1:9190", "HOST:PORT of /metrics (its own port, never the ext_proc one)")


class ListenerTlsFiles(Section):
    """``grpc.tls:``: files only, never inline PEM; re-read when they change."""

    cert_file: str = Field(description="PEM certificate chain")
    key_file: str = Field(description="PEM private key")
    client_ca_file: str | None = _doc(None, "mutual TLS: refuse clients without a certificate this CA signed")


class Grpc(Section):
    """``grpc:``: the ext_proc listener."""

    max_message_bytes: int = _doc(32 * 1024 * 1024, "a buffered body arrives as one message", ge=1024)
    health_listen: str | None = _doc(None, "also serve gRPC health alone, in plaintext, here (kubelet probes)")
    tls: ListenerTlsFiles | None = _doc(None, "TLS on the listener (off by default: loopback)")


class Admin(Section):
    """``admin:``: the admin gRPC API (Explain, replicas, sessions, cordon, drain, watch)."""

    enabled: bool = _doc(True, "serve the admin API (`extproc admin` talks to it)")
    listen: str | None = _doc(
        None, "null: on the ext_proc port (`listen`); HOST:PORT: a port of its own; 'off': not served"
    )
    token_file: str | None = _doc(
        None,
        "file holding the bearer token that mutating calls need (without it, or mTLS, they are refused); "
        "on an ext_proc port off loopback, every call needs it",
    )
    tls: ListenerTlsFiles | None = _doc(
        None, "TLS on admin.listen's own port; with client_ca_file, a client certificate also authorises mutations"
    )
    watch_sample_rate: float = _doc(
        0.1, "share of decisions WatchDecisions sends when the watcher asks for none", gt=0, le=1
    )


class HealthWeightsSection(Section):
    """``health.weights:``: how much each signal counts in the health score."""

    queue: float = _doc(_WEIGHTS.queue, "queued requests", ge=0)
    kv_cache: float = _doc(_WEIGHTS.kv_cache, "KV-cache usage", ge=0)
    ttft: float = _doc(_WEIGHTS.ttft, "time to first token over the SLO", ge=0)
    errors: float = _doc(_WEIGHTS.errors, "upstream error rate", ge=0)


class HealthLimitsSection(Section):
    """``health.limits:``: where each penalty starts and where it is full."""

    queue_full: int = _doc(_LIMITS.queue_full, "queue length at which the queue penalty is full", ge=1)
    kv_start: float = _doc(_LIMITS.kv_start, "KV usage where its penalty starts", ge=0, le=1)
    ttft_slo_s: float = _doc(_LIMITS.ttft_slo_s, "TTFT p99 target", gt=0)
    error_rate_full: float = _doc(_LIMITS.error_rate_full, "error rate at which its penalty is full", gt=0, le=1)
    unreachable_after: int = _doc(_LIMITS.unreachable_after, "failed scrapes in a row before unreachable", ge=1)


class Health(Section):
    """``health:``: scraping vLLM's /metrics, the health score and the rotation."""

    scrape_interval_s: float = _doc(_HEALTH.scrape_interval_s, "how often each replica's /metrics is read", ge=0.01)
    scrape_timeout_s: float = _doc(_HEALTH.scrape_timeout_s, "a scrape slower than this failed", ge=0.001)
    stale_after_s: float = _doc(_HEALTH.stale_after_s, "load figures older than this are ignored", ge=0.01)
    metrics_path: str = _doc(_HEALTH.metrics_path, "the replicas' metrics path")
    eject_below: float = _doc(_ROTATION.eject_below, "a health score below this counts toward ejection", ge=0, le=1)
    eject_after: int = _doc(_ROTATION.eject_after, "scores below eject_below in a row before ejection", ge=1)
    readmit_above: float = _doc(_ROTATION.readmit_above, "a score above this counts toward readmission", ge=0, le=1)
    readmit_after: int = _doc(_ROTATION.readmit_after, "scores above readmit_above in a row to readmit", ge=1)
    cooldown_s: float = _doc(_ROTATION.cooldown_s, "an ejected replica stays out at least this long", ge=0)
    upstream_fail_after: int = _doc(
        _HEALTH.upstream_fail_after, "502/503/504 or no answer in a row seen by Envoy: ejected at once", ge=1
    )
    ttft_window_s: float = _doc(_HEALTH.ttft_window_s, "window of the TTFT p99", ge=1)
    response_sample_rate: float = _doc(
        _HEALTH.response_sample_rate, "share of requests whose response headers are observed", ge=0, le=1
    )
    weights: HealthWeightsSection = _doc(HealthWeightsSection(), "how much each signal counts")
    limits: HealthLimitsSection = _doc(HealthLimitsSection(), "where each penalty starts and is full")


class Upstream(Section):
    """``upstream:``: per-try bounds, shared with ``extproc envoy-config`` (docs/operations.md: hung replicas)."""

    first_byte_s: float = _doc(
        _UPSTREAM.first_byte_s, "a try without response headers by then is retried on another replica", ge=0.001
    )
    stream_idle_s: float = _doc(
        _UPSTREAM.stream_idle_s, "a stream silent this long is ended (must exceed 3 x first_byte_s)", ge=0.001
    )
    unary_s_per_output_token: float = _doc(
        _UPSTREAM.unary_s_per_output_token, "a non-streaming try waits first_byte_s + this x max_tokens", ge=0
    )
    unary_max_s: float = _doc(
        _UPSTREAM.unary_max_s,
        "a non-streaming try's budget at most (and without max_tokens); then another replica too. 0: no cap",
        ge=0,
    )
    stream_header: str = _doc(
        _UPSTREAM.stream_header, "marks streaming requests for Envoy's idle-timeout route", min_length=1
    )


class Spillover(Section):
    """``spillover:``: requests of an overloaded replica's sessions go elsewhere."""

    repin: bool = _doc(False, "move the session's pin to where it spilled (else it returns when the load drops)")


class Prewarm(Section):
    """``rebalance.prewarm:``: prefill-only requests that warm a moved session's new replica."""

    enabled: bool = _doc(_PREWARM.enabled, "off: in the simulator pre-warms during fleet changes cost more")
    rate_per_s: float = _doc(_PREWARM.rate_per_s, "pre-warm requests per second at most", ge=0.001)
    burst: int = _doc(_PREWARM.burst, "token-bucket burst", ge=1)
    queue: int = _doc(_PREWARM.queue, "pending pre-warms kept at most", ge=1)
    timeout_s: float = _doc(_PREWARM.timeout_s, "a pre-warm slower than this is abandoned", ge=0.001)


class Rebalance(Section):
    """``rebalance:``: moving sessions when replicas leave, join or run hot."""

    enabled: bool = _doc(_REBALANCE.enabled, "rebalance at all")
    move_on_join: bool = _doc(_REBALANCE.move_on_join, "move a newcomer's ring share of live sessions to it")
    session_cooldown_s: float = _doc(_REBALANCE.session_cooldown_s, "a moved session is not moved again sooner", ge=0)
    hot_kv: float = _doc(_REBALANCE.hot_kv, "KV usage over which a replica is hot", ge=0, le=1)
    hot_queue: int = _doc(_REBALANCE.hot_queue, "queue over which a replica is hot", ge=0)
    hot_for_s: float = _doc(_REBALANCE.hot_for_s, "hot this long before it sheds sessions", ge=0)
    shed_fraction: float = _doc(_REBALANCE.shed_fraction, "share of a hot replica's sessions moved", ge=0, le=1)
    replica_cooldown_s: float = _doc(_REBALANCE.replica_cooldown_s, "a replica sheds at most this often", ge=0)
    ledger_sessions: int = _doc(_REBALANCE.ledger_sessions, "sessions whose last request is kept for moves", ge=1)
    ledger_bytes: int = _doc(_REBALANCE.ledger_bytes, "bytes of kept requests at most", ge=1)
    prewarm: Prewarm = _doc(Prewarm(), "warming a moved session's new replica")


class TenantDefinition(Section):
    """One tenant under ``tenants.definitions``."""

    max_concurrent: int | None = _doc(_TENANT.max_concurrent, "requests in flight at most", ge=1)
    max_share: float | None = _doc(_TENANT.max_share, "share of the fleet's capacity at most", gt=0, le=1)
    shard_size: int = _doc(_TENANT.shard_size, "replicas of its shard (0: the whole fleet)", ge=0)
    over_quota: Literal["reject", "overflow"] = _doc(_TENANT.over_quota, "429 + Retry-After, or the overflow pool")
    retry_after_s: int = _doc(_TENANT.retry_after_s, "the Retry-After of a rejection", ge=1)


class Tenants(Section):
    """``tenants:``: who a request belongs to, and quotas."""

    header: str = _doc(_FEATURES.tenant_header, "the header naming the tenant when no API key maps the request")
    api_keys: dict[str, str] = _doc({}, "hex SHA-256 digest of an API key -> tenant (never the keys)")
    api_keys_file: str | None = _doc(None, "a YAML/JSON file of the same mapping")
    replica_capacity: int = _doc(_TENANTS.replica_capacity, "requests one replica takes at once (for shares)", ge=1)
    per_replica: int = _doc(_TENANTS.per_replica, "a tenant's fair in-flight count per replica", ge=1)
    overflow_pool: dict[str, str] = _doc(dict(_TENANTS.overflow_pool), "labels of the overflow pool")
    definitions: dict[str, TenantDefinition] = _doc({}, "per-tenant quotas, by tenant name")


class ClassMatch(Section):
    """``classes[].match:``: every condition given must hold."""

    min_tokens: int | None = _doc(None, "estimated prompt tokens at least")
    max_tokens: int | None = _doc(None, "estimated prompt tokens at most")
    stream: bool | None = _doc(None, "streamed or not")
    media: bool | None = _doc(None, "images or audio in the messages")
    headers: dict[str, str] = _doc({}, "header values (exact)")
    models: str | list[str] = _doc([], "model name globs")


class ClassRuleSection(Section):
    """One item of ``classes:``, first match wins."""

    name: str = Field(description="the class, as metrics and logs name it")
    match: ClassMatch = _doc(ClassMatch(), "which requests belong to it")
    pool: dict[str, str] = _doc({}, "replica labels its requests are confined to")
    profile: str | None = _doc(None, "a profile under profiles: (else the default)")


class PluginSpec(Section):
    """A filter or picker of a profile: its registered ``type`` and its ``parameters``."""

    type: str = Field(description="the plugin's registered name")
    parameters: dict[str, Any] = _doc({}, "the plugin's own fields, checked against its types")


class ScorerSpec(PluginSpec):
    """A scorer of a profile, with its weight."""

    weight: float = _doc(1.0, "what its [0, 1] score is multiplied by", ge=0)


class ProfileSpec(Section):
    """A routing profile: filters, weighted scorers, one picker (missing parts: the default's)."""

    name: str | None = _doc(None, "as metrics name it")
    filters: list[PluginSpec] | None = _doc(None, "candidates removed, in order")
    scorers: list[ScorerSpec] | None = _doc(None, "weighted scores summed per replica")
    picker: PluginSpec | None = _doc(None, "chooses among the scored candidates")


class SplitMatch(Section):
    """``splits[].match:``: every condition given must hold."""

    model: str | None = _doc(None, "model name glob")
    headers: dict[str, str] = _doc({}, "header values (exact)")
    cookies: dict[str, str] = _doc({}, "cookie values (exact)")
    query: dict[str, str] = _doc({}, "query parameter values (exact)")


class SplitTargetSection(Section):
    """One arm of a split: the model name written into the request body."""

    model: str = Field(description="the model (or adapter) served to this arm", min_length=1)
    weight: float = _doc(1.0, "its share, relative to the rule's other targets", ge=0)
    pool: str | None = _doc(None, "confine the arm to replicas labelled pool=LABEL")


class SplitRuleSection(Section):
    """One item of ``splits:``, first match wins; the arm is hashed on the session (else user, else request)."""

    name: str | None = _doc(None, "as metrics name it (default: split-INDEX)")
    match: SplitMatch = _doc(SplitMatch(), "which requests it takes")
    targets: list[SplitTargetSection] = Field(description="weighted arms", min_length=1)
    pin_header: str = _doc("x-canary", "a request naming a target model here is pinned to that arm", min_length=1)


class QueueClassSection(Section):
    """A request class's terms while the fleet is full (``queueing.default``, ``queueing.classes.NAME``)."""

    priority: int = _doc(_QUEUE_CLASS.priority, "higher is released first and never waits behind lower")
    max_wait_s: float = _doc(_QUEUE_CLASS.max_wait_s, "held at most this long, then refused", gt=0)
    max_queued: int = _doc(_QUEUE_CLASS.max_queued, "requests of its priority held at most", ge=1)
    status: Literal[429, 503] = _doc(_QUEUE_CLASS.status, "the refusal's status (with Retry-After)")
    retry_after_s: int = _doc(_QUEUE_CLASS.retry_after_s, "the refusal's Retry-After", ge=1)


class Queueing(Section):
    """``queueing:``: hold requests while every candidate replica is saturated (off by default)."""

    enabled: bool = _doc(_QUEUEING.enabled, "hold requests instead of sending them to saturated replicas")
    kv_threshold: float = _doc(_QUEUEING.kv_threshold, "KV usage over which a replica is saturated", ge=0, le=1)
    queue_threshold: int = _doc(
        _QUEUEING.queue_threshold, "queued requests over which it is saturated (sent since the last scrape count)", ge=0
    )
    max_inflight_per_replica: int = _doc(
        _QUEUEING.max_inflight_per_replica,
        "requests in flight from this router at which it is saturated (0: off)",
        ge=0,
    )
    default: QueueClassSection = _doc(QueueClassSection(), "classes not named below (interactive)")
    classes: dict[str, QueueClassSection] = _doc(
        {name: QueueClassSection(**dataclasses.asdict(c)) for name, c in _QUEUEING.classes.items()},
        "terms by request class (classes:)",
    )


class KvEvents(Section):
    """``kv_events:``: vLLM's KV-cache events, matched for models with a tokenizer (docs/kv-events.md)."""

    listen: str | None = _doc(
        None, "bind one SUB endpoint replicas connect to (tcp://0.0.0.0:5557, ipc://...)", pattern=r"^[a-z]+://."
    )
    port: int | None = _doc(None, "discovered replicas publish on this port", ge=1, le=65535)
    replay_port: int | None = _doc(None, "discovered replicas answer replays on this port", ge=1, le=65535)
    hash_algo: Literal["sha256", "sha256_cbor", "content"] = _doc(
        _KV.hash_algo.value, "the engines' --prefix-caching-hash-algo; content when not reproducible (xxhash)"
    )
    hash_seed: str | int | None = _doc(None, "the engines' PYTHONHASHSEED, if they set one")
    block_size: int = _doc(_KV.block_size, "the engines' block size in tokens until they report theirs", ge=1)
    data_parallel_size: int = _doc(
        _KV.data_parallel_size, "engines per replica (--data-parallel-size): rank r publishes on port + r", ge=1
    )
    stale_after_s: float = _doc(_KV.stale_after_s, "a feed silent this long while serving falls back", ge=0.01)
    speculative_ttl_s: float = _doc(_KV.speculative_ttl_s, "a decision credits its blocks this long", ge=0)
    replay_timeout_s: float = _doc(_KV.replay_timeout_s, "an unanswered replay fails: the replica is cleared", ge=0.01)
    max_blocks_per_replica: int = _doc(_KV.max_blocks_per_replica, "indexed blocks kept per replica", ge=1)
    check_sample_rate: float = _doc(
        _KV.check_sample_rate, "share of responses read for usage.cached_tokens to check predictions", ge=0, le=1
    )
    stale_after_mispredictions: int = _doc(
        _KV.stale_after_mispredictions, "wrong checked predictions in a row that make a feed stale (0: never)", ge=0
    )
    unpin_below: float = _doc(
        _KV.unpin_below, "below this share of the prompt held, its events judge a pin lost", ge=0, le=1
    )
    tokenizers: dict[str, str] = _doc({}, "model name -> directory with tokenizer.json, tokenizer_config.json")
    lora_adapters: dict[str, str] = _doc({}, "LoRA adapter name -> its base model (hashed with the name, as vLLM)")


class HotKeys(Section):
    """``hot_keys:``: find prefixes that carry a disproportionate share and serve each from k replicas."""

    enabled: bool = _doc(_HOT.enabled, "sample prefix fingerprints and spread hot prefixes")
    sample_rate: float = _doc(_HOT.sample_rate, "share of requests whose fingerprint is counted", gt=0, le=1)
    window_s: float = _doc(_HOT.window_s, "length of a counting window", gt=0)
    buckets: int = _doc(_HOT.buckets, "buckets of the sketch (fingerprints hashed into them)", ge=1)
    per_bucket: int = _doc(_HOT.per_bucket, "top fingerprints kept per bucket", ge=1)
    threshold: float = _doc(_HOT.threshold, "hot at this many times the mean count per key", gt=1)
    windows: int = _doc(_HOT.windows, "consecutive windows above (below) it to turn hot (cool)", ge=1)
    min_samples: int = _doc(_HOT.min_samples, "sampled requests a key needs in a window to be hot", ge=1)
    max_hot: int = _doc(_HOT.max_hot, "hot keys kept at most (also bounds the metric's labels)", ge=1)
    max_replicas: int = _doc(_HOT.max_replicas, "replicas a hot prefix is spread over at most", ge=1)
    replica_prefill_tokens_per_s: float = _doc(
        _HOT.replica_prefill_tokens_per_s, "one replica's prefill capacity: a replica per this much demand", gt=0
    )
    linger_windows: int = _doc(
        _HOT.linger_windows, "windows a cooled prefix keeps k by its own rate (1 without traffic)", ge=0
    )
    warm_on_join: bool = _doc(_HOT.warm_on_join, "send a joining replica the top hot prefixes, prefill only")
    warm_top: int = _doc(_HOT.warm_top, "hot prefixes a joining replica is warmed with at most", ge=0)
    warm_max_bytes: int = _doc(_HOT.warm_max_bytes, "a hot prefix's kept request body at most (bytes)", ge=1)


class RouterFile(Section):
    """The whole file. Every key is optional: ``extproc serve --replica ...`` runs without one."""

    listen: str = _doc("127.0.0.1:9002", "the ext_proc gRPC listener: HOST:PORT or unix:/path")
    mode: Literal["cluster", "endpoint"] = _doc(
        "cluster", "cluster: a target-cluster header; endpoint: GIE's destination-endpoint header"
    )
    headers: Headers = _doc(Headers(), "routing header names")
    replicas: list[ReplicaEntry] = _doc([], "static replicas (discovery may add more)")
    discovery: dict[str, Any] | None = _doc(
        None, "where members come from: type static (default), dns or kubernetes; see docs/configuration.md"
    )
    workers: int = _doc(1, "processes serving the ext_proc port, sharing state in memory (docs/deployment.md)", ge=1)
    store: str = _doc(
        "memory://", "affinity store URL: memory://, redis://, rediss://, unix://, redis+sentinel://, ..."
    )
    sessions: Sessions = _doc(Sessions(), "session pins")
    request: Request = _doc(Request(), "session and tenant sources")
    prefix: Prefix = _doc(Prefix(), "prefix hashing and index")
    ring: Ring = _doc(Ring(), "the consistent-hash ring")
    metrics: Metrics = _doc(Metrics(), "Prometheus /metrics")
    grpc: Grpc = _doc(Grpc(), "the gRPC listener")
    admin: Admin = _doc(Admin(), "the admin API, on the ext_proc port unless given its own (docs/ports.md)")
    health: Health = _doc(Health(), "replica health and rotation")
    spillover: Spillover = _doc(Spillover(), "overloaded replicas")
    upstream: Upstream = _doc(Upstream(), "how long Envoy waits for a replica")
    kv_events: KvEvents = _doc(KvEvents(), "vLLM's KV-cache events")
    rebalance: Rebalance = _doc(Rebalance(), "moving sessions")
    tenants: Tenants = _doc(Tenants(), "tenants and quotas")
    classes: list[ClassRuleSection] = _doc([], "request classes, first match wins")
    profile: ProfileSpec | None = _doc(None, "the routing profile (default: the shipped one)")
    profiles: dict[str, ProfileSpec] = _doc({}, "named profiles that classes may use")
    splits: list[SplitRuleSection] = _doc([], "canary and A/B splits with model rewrites, first match wins")
    queueing: Queueing = _doc(Queueing(), "priority and fair queueing when the fleet is full")
    hot_keys: HotKeys = _doc(HotKeys(), "hot-prefix detection and replication")


def parse_file(raw: Mapping[str, Any]) -> RouterFile:
    """Validate a parsed YAML mapping; :class:`ValueError` naming every bad field."""
    try:
        return RouterFile.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(describe(exc)) from None


# --- the example file ---------------------------------------------------------------------------

EXAMPLE_HEADER = """\
# extproc router config: every key, its default and what it does.
# Generated from extproc/config_schema.py (`make example-config`);
# tests/test_config.py keeps the two equal. Every key is optional.
"""


def _example_values() -> dict[str, Any]:
    """Values the example shows instead of an empty default."""
    return {
        "profile": _with_parameters(DEFAULT_PROFILE),
        "replicas": [
            {"name": "replica-0", "address": "127.0.0.1:8001", "kv_events": "tcp://127.0.0.1:5557"},
            {"name": "replica-1", "address": "127.0.0.1:8002"},
            {"name": "replica-2", "address": "127.0.0.1:8003", "weight": 2},
        ],
    }


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = value and not any(c in value for c in ":#{}[],&*!|>'\"%@`") and value.strip() == value
        return value if plain and value not in ("null", "true", "false", "yes", "no") else repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _commented(text: str, doc: str) -> str:
    return f"{text.ljust(38)}  # {doc}" if doc else text


def _lines(model: type[Section], indent: str, overrides: Mapping[str, Any]) -> Iterator[str]:
    for name, info in model.model_fields.items():
        doc = info.description or ""
        default = overrides.get(name, info.default)
        if isinstance(default, Section):
            yield _commented(f"{indent}{name}:", doc)
            yield from _lines(type(default), indent + "  ", {})
        elif isinstance(default, list) and default and isinstance(default[0], dict):
            yield _commented(f"{indent}{name}:", doc)
            for item in default:
                yield f"{indent}  - {_scalar(item)}"
        elif isinstance(default, dict) and any(isinstance(v, list) for v in default.values()):
            yield _commented(f"{indent}{name}:", doc)  # a profile: one plugin a line
            for key, value in default.items():
                if isinstance(value, list):
                    yield f"{indent}  {key}:"
                    yield from (f"{indent}    - {_scalar(item)}" for item in value)
                else:
                    yield f"{indent}  {key}: {_scalar(value)}"
        elif isinstance(default, dict) and default and all(isinstance(v, Section) for v in default.values()):
            yield _commented(f"{indent}{name}:", doc)
            for key, value in default.items():
                yield f"{indent}  {key}: {_scalar(value.model_dump())}"
        elif isinstance(default, dict) and default and all(isinstance(v, dict) for v in default.values()):
            yield _commented(f"{indent}{name}:", doc)
            for key, value in default.items():
                yield f"{indent}  {key}: {_scalar(value)}"
        else:
            yield _commented(f"{indent}{name}: {_scalar(default)}", doc)


def _with_parameters(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` with each plugin's parameters spelled out at their defaults."""

    def spell(kind: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
        fields = dataclasses.fields(kind[spec["type"]])
        params = {f.name: f.default for f in fields if f.name != "name" and f.default is not dataclasses.MISSING}
        out = {k: v for k, v in spec.items() if k != "parameters"}
        return {**out, "parameters": params} if params else out

    return {
        "filters": [spell(REGISTRY.filters, f) for f in profile["filters"]],
        "scorers": [spell(REGISTRY.scorers, f) for f in profile["scorers"]],
        "picker": spell(REGISTRY.pickers, profile["picker"]),
    }


def example_yaml() -> str:
    """``examples/router.yaml``: every option of :class:`RouterFile`, its default and one line of doc."""
    return EXAMPLE_HEADER + "\n".join(line.rstrip() for line in _lines(RouterFile, "", _example_values())) + "\n"
