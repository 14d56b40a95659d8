"""The router's config as one model: the YAML file's shape, validated once at start-up, and the
runtime value every subsystem reads (``config.sessions.ttl_s``, ``config.health.weights.queue``).

Each subsystem's section lives beside the subsystem (``HealthSettings`` in
:mod:`extproc.health.settings`, ``QueueSettings`` in :mod:`extproc.queueing.settings`, ...);
this module holds the sections no subsystem owns and composes the root. Unknown keys are
rejected in every section, types are strict (``"high"`` is not a number, ``true`` is not an
integer), ranges are checked, and an error names the full path of the field
(``health.limits.queue_full``). ``examples/router.yaml`` is generated from these models
(:mod:`extproc.config.example`; a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import Field, GetPydanticSchema, field_validator, model_validator
from pydantic_core import core_schema

from extproc.budgets import BudgetSettings
from extproc.discovery.settings import DiscoverySettings, StaticSource
from extproc.health.settings import HealthSettings
from extproc.hotkeys.detector import HotKeySettings
from extproc.kvevents.settings import KvEventSettings
from extproc.queueing.settings import QueueSettings
from extproc.rebalance.rebalancer import RebalanceSettings
from extproc.request.classes import ClassRule
from extproc.request.features import FeatureSettings
from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc.request.objectives import Objectives
from extproc.request.session import SessionSource
from extproc.request.splits import SplitRule, SplitTarget
from extproc.routing.disagg import PairSettings
from extproc.routing.model import Replica
from extproc.routing.registry import DEFAULT_PROFILE, ProfileError, build_profile
from extproc.state.store_url import parse_store_url
from extproc.tenancy import TenantSettings
from extproc.tracing import TracingSettings
from extproc.upstream_timeouts import UpstreamTimeouts
from extproc.validation import Section, field_error, option

Mode = Literal["cluster", "endpoint"]
_ENDPOINT = r"^[a-z]+://."


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""


def held_as(entry: type, runtime: type | None, build: Callable[[Any], Any], dump: Callable[[Any], Any]) -> Any:
    """A field read from the file as ``entry`` and held as the ``runtime`` object ``build``
    makes of it (what the request layer matches with); a ``runtime`` object given in code is
    taken as it is (None: everything is read as ``entry``). ``dump`` writes it back as the file
    spells it."""

    def held(value: Any, validate: Callable[[Any], Any]) -> Any:
        return value if runtime is not None and isinstance(value, runtime) else build(validate(value))

    def schema(_source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_wrap_validator_function(
            held,
            handler.generate_schema(entry),
            serialization=core_schema.plain_serializer_function_ser_schema(dump),
        )

    return GetPydanticSchema(schema)


# --- replicas -----------------------------------------------------------------------------------

REPLICA_KV_FIELDS = ("kv_events", "kv_replay", "kv_dp")
"""A ``replicas:`` entry's KV-event fields: the labels a ``--replica`` flag carries them in."""


class ReplicaEntry(Section):
    """One item of ``replicas:``."""

    name: str = Field(description="in cluster mode, the replica's Envoy cluster")
    address: str = Field(description="HOST:PORT of its OpenAI server (and /metrics)")
    weight: float = option(1.0, "share of the ring, e.g. 2 for twice the GPUs", gt=0)
    labels: dict[str, str] = option({}, "labels pools and classes select on")
    kv_events: str | None = option(
        None, "its engines' KV-event publisher (vLLM --kv-events-config endpoint, tcp://HOST:PORT)", pattern=_ENDPOINT
    )
    kv_replay: str | None = option(None, "its engines' replay endpoint (replay_endpoint)", pattern=_ENDPOINT)
    kv_dp: int | None = option(
        None, "engines behind it (--data-parallel-size; default kv_events.data_parallel_size)", ge=1
    )

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        check_address(address)
        return address

    @model_validator(mode="after")
    def _kv_labels(self) -> ReplicaEntry:
        for key in REPLICA_KV_FIELDS:
            value = getattr(self, key)
            if value is not None and key in self.labels and self.labels[key] != str(value):
                raise field_error(ReplicaEntry, key, f"{value!r}, but labels.{key} says {self.labels[key]!r}", value)
        if self.kv_replay is not None and self.kv_events is None and "kv_events" not in self.labels:
            raise field_error(ReplicaEntry, "kv_replay", "needs kv_events (the publisher it replays)", self.kv_replay)
        return self

    def replica(self) -> Replica:
        """The replica, with its KV-event fields as the labels the subscriptions read."""
        labels = dict(self.labels)
        labels.update({key: str(getattr(self, key)) for key in REPLICA_KV_FIELDS if getattr(self, key) is not None})
        return Replica(self.name, self.address, self.weight, labels)


def check_address(address: str) -> None:
    """``HOST:PORT``, or ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")


def replica_entry(replica: Replica) -> dict[str, Any]:
    """A replica as its ``replicas:`` entry spells it (its KV-event fields among its labels)."""
    return {"name": replica.name, "address": replica.address, "weight": replica.weight, "labels": dict(replica.labels)}


ReplicaItem = Annotated[Replica, held_as(ReplicaEntry, Replica, ReplicaEntry.replica, replica_entry)]


def parse_replica(spec: str) -> Replica:
    """``NAME=HOST:PORT[,LABEL=VALUE...]`` (or just ``HOST:PORT``, named after its address)."""
    head, *label_specs = spec.split(",")
    name, sep, address = head.partition("=")
    if not sep:
        name, address = head.replace(":", "_").replace(".", "-"), head
    try:
        check_address(address)
    except ValueError as exc:
        raise ConfigError(f"replica {spec!r}: {exc}") from None
    labels = {}
    for item in label_specs:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"replica {spec!r}: labels are LABEL=VALUE, got {item!r}")
        labels[key.strip()] = value.strip()
    return Replica(name=name.strip(), address=address.strip(), labels=labels)


# --- sections no subsystem owns -----------------------------------------------------------------


class Headers(Section):
    """``headers:``: the names of the routing headers the processor sets (and strips from clients)."""

    target_cluster: str = option("x-target-cluster", "cluster mode: the header a route's cluster_header reads")
    destination_endpoint: str = option(
        "x-gateway-destination-endpoint", "endpoint mode: the GIE endpoint-picker header (ip:port)"
    )

    @field_validator("target_cluster", "destination_endpoint")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


class Sessions(Section):
    """``sessions:``."""

    ttl_s: float = option(600.0, "a session's pin expires this long after its last turn (sliding)", gt=0)
    max_sessions: int = option(100_000, "pins kept at most (LRU)", ge=1)


SessionSourceItem = Annotated[
    SessionSource, held_as(str, SessionSource, SessionSource.parse, lambda s: f"{s.kind}:{s.name}")
]


class Request(Section):
    """``request:``: how a request's session is found, and how much of it is parsed."""

    session_sources: tuple[SessionSourceItem, ...] = option(
        FeatureSettings().session_sources,
        "where the session key is read, first found wins (header:, cookie:, body: dotted path)",
        strict=False,
    )
    max_body_bytes: int = option(
        FeatureSettings().max_body_bytes, "larger bodies are routed on the session key without parsing", ge=1
    )
    conversations: bool = option(
        FeatureSettings().conversations,
        "a chat request without a session key is known by its messages (its conversation's session)",
    )


class Prefix(Section):
    """``prefix:``: prefix block hashing and the prefix index."""

    block_chars: int = option(
        FeatureSettings().block_chars, "characters per block: 16 tokens x ~4 characters, as GIE", ge=1
    )
    max_blocks: int = option(FeatureSettings().max_blocks, "blocks hashed at most (the first 128 KB of a prompt)", ge=1)
    blocks_per_replica: int = option(31_250, "prefix index entries kept per replica", ge=1)


class Ring(Section):
    """``ring:``: the consistent-hash ring that places new sessions on an idle fleet."""

    vnodes: int = option(128, "virtual nodes per replica (times its weight)", ge=1)
    key_blocks: int = option(32, "a request without a session is hashed on its first blocks (2 KB)", ge=1)


class Metrics(Section):
    """``metrics:``: Prometheus exposition."""

    enabled: bool = option(True, "serve /metrics")
    listen: str = option("127.0.0.1:9190", "HOST:PORT of /metrics (its own port, never the ext_proc one)")

    @property
    def address(self) -> str | None:
        """Where /metrics is served, None when it is not."""
        return self.listen if self.enabled else None


class ListenerTls(Section):
    """TLS on a listener (``grpc.tls``, ``admin.tls``, or ``--tls-cert``/``--tls-key``).

    Files only, never inline PEM, so the key stays out of config files and process listings;
    re-read when they change. With ``client_ca_file`` it is mutual TLS: a client must present a
    certificate that CA signed.
    """

    cert_file: str = Field(description="PEM certificate chain")
    key_file: str = Field(description="PEM private key")
    client_ca_file: str | None = option(None, "mutual TLS: refuse clients without a certificate this CA signed")

    @property
    def mutual(self) -> bool:
        """Whether client certificates are required."""
        return self.client_ca_file is not None


class Grpc(Section):
    """``grpc:``: the ext_proc listener."""

    max_message_bytes: int = option(32 * 1024 * 1024, "a buffered body arrives as one message", ge=1024)
    # kubelet's gRPC probes speak plaintext, so with tls they need a listener of their own.
    health_listen: str | None = option(None, "also serve gRPC health alone, in plaintext, here (kubelet probes)")
    tls: ListenerTls | None = option(None, "TLS on the listener (off by default: loopback)")
    secure_serving: bool | None = option(
        None,
        "without tls: serve TLS with a self-signed certificate made at start (as GIE's picker); "
        "null: on when following an InferencePool (discovery type inference_pool), else off",
    )
    grace_s: float = option(5.0, "on SIGTERM, streams in flight get this long to finish", ge=0)


class AdminSettings(Section):
    """``admin:``: the admin gRPC API (Explain, replicas, sessions, cordon, drain, watch).

    On the ext_proc port by default (``listen`` null), on a port of its own with ``listen``, not
    at all without ``enabled`` (``listen: 'off'`` is read as ``enabled: false``).
    """

    enabled: bool = option(True, "serve the admin API (`extproc admin` talks to it)")
    listen: str | None = option(
        None, "null: on the ext_proc port (`listen`); HOST:PORT: a port of its own; 'off': not served"
    )
    token_file: str | None = option(
        None,
        "file holding the bearer token that mutating calls need (without it, or mTLS, they are refused); "
        "on an ext_proc port off loopback, every call needs it",
    )
    tls: ListenerTls | None = option(
        None, "TLS on admin.listen's own port; with client_ca_file, a client certificate also authorises mutations"
    )
    watch_sample_rate: float = option(
        0.1, "share of decisions WatchDecisions sends when the watcher asks for none", gt=0, le=1
    )

    @model_validator(mode="before")
    @classmethod
    def _off(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping) and raw.get("listen") == "off":
            return {**raw, "enabled": False, "listen": None}
        return raw

    @model_validator(mode="after")
    def _tls_needs_its_own_port(self) -> AdminSettings:
        if self.tls is not None and self.enabled and self.listen is None:
            # On the ext_proc port the admin API is served with grpc.tls; admin.tls alone would be ignored.
            raise field_error(
                AdminSettings,
                "tls",
                "TLS of a separate admin listener, so set admin.listen too (see docs/ports.md)",
                None,
            )
        return self


class Spillover(Section):
    """``spillover:``: requests of an overloaded replica's sessions go elsewhere."""

    repin: bool = option(False, "move the session's pin to where it spilled (else it returns when the load drops)")


class Disaggregation(Section):
    """``disaggregation:``: how a prefill/decode pair is weighed where replicas carry roles
    (``llm-d.ai/role``; docs/disaggregation.md). A fleet without roles never reads it."""

    threshold_tokens: int = option(
        PairSettings().threshold_tokens, "prompt tokens the decode replica lacks below which it prefills itself", ge=0
    )
    decode_interference: float = option(
        PairSettings().decode_interference,
        "the stall of each sequence decoding, per prompt token a decode replica prefills itself",
        ge=0,
    )

    weigh_local: bool = option(
        True,
        "hop only if the prefill replica finishes the prompt sooner than the decode replica would; "
        "false: whenever the decode replica lacks threshold_tokens (llm-d's threshold decider)",
    )

    def pair_settings(self, block_tokens: int) -> PairSettings:
        """The pair's settings, with the KV block size in tokens."""
        return PairSettings(
            threshold_tokens=self.threshold_tokens,
            decode_interference=self.decode_interference,
            weigh_local=self.weigh_local,
            block_tokens=max(1, block_tokens),
        )


# --- request classes ------------------------------------------------------------------------------


class ClassMatch(Section):
    """``classes[].match:``: every condition given must hold."""

    min_tokens: int | None = option(None, "estimated prompt tokens at least")
    max_tokens: int | None = option(None, "estimated prompt tokens at most")
    stream: bool | None = option(None, "streamed or not")
    media: bool | None = option(None, "images or audio in the messages")
    headers: dict[str, str] = option({}, "header values (exact)")
    models: str | list[str] = option([], "model name globs")


class ClassEntry(Section):
    """One item of ``classes:``, first match wins."""

    name: str = Field(description="the class, as metrics and logs name it")
    match: ClassMatch = option(ClassMatch(), "which requests belong to it")
    pool: dict[str, str] = option({}, "replica labels its requests are confined to")
    profile: str | None = option(None, "a profile under profiles: (else the default)")
    objectives: Objectives | None = option(
        None, "latency objectives (ttft_ms, tpot_ms) of its requests; their own x-slo-* may only be stricter"
    )

    def rule(self) -> ClassRule:
        """The class as the request layer matches it."""
        m = self.match
        return ClassRule(
            name=self.name,
            min_tokens=m.min_tokens,
            max_tokens=m.max_tokens,
            stream=m.stream,
            media=m.media,
            headers={k.lower(): v for k, v in m.headers.items()},
            models=tuple(m.models if isinstance(m.models, list) else [m.models]),
            pool=dict(self.pool),
            profile=self.profile,
            objectives=self.objectives,
        )


def _class_entry(rule: ClassRule) -> dict[str, Any]:
    match: dict[str, Any] = {
        "min_tokens": rule.min_tokens,
        "max_tokens": rule.max_tokens,
        "stream": rule.stream,
        "media": rule.media,
    }
    match = {k: v for k, v in match.items() if v is not None} | {"headers": dict(rule.headers)}
    match["models"] = list(rule.models)
    objectives = rule.objectives.model_dump() if rule.objectives is not None else None
    return {
        "name": rule.name,
        "match": match,
        "pool": dict(rule.pool),
        "profile": rule.profile,
        "objectives": objectives,
    }


ClassItem = Annotated[ClassRule, held_as(ClassEntry, ClassRule, ClassEntry.rule, _class_entry)]


# --- profiles -----------------------------------------------------------------------------------


class PluginSpec(Section):
    """A filter or picker of a profile: its registered ``type`` and its ``parameters``."""

    type: str = Field(description="the plugin's registered name")
    parameters: dict[str, Any] = option({}, "the plugin's own fields, checked against its types")


class ScorerSpec(PluginSpec):
    """A scorer of a profile, with its weight."""

    weight: float = option(1.0, "what its [0, 1] score is multiplied by", ge=0)


class ProfileSpec(Section):
    """A routing profile: filters, weighted scorers, one picker (missing parts: the default's)."""

    name: str | None = option(None, "as metrics name it")
    filters: list[PluginSpec] | None = option(None, "candidates removed, in order")
    scorers: list[ScorerSpec] | None = option(None, "weighted scores summed per replica")
    picker: PluginSpec | None = option(None, "chooses among the scored candidates")

    def mapping(self) -> dict[str, Any]:
        """The profile as :func:`~extproc.routing.registry.build_profile` reads it."""
        return self.model_dump(exclude_none=True)


# A profile is held as the mapping build_profile reads; the file's is checked as a ProfileSpec.
ProfileMapping = Annotated[dict[str, Any], held_as(ProfileSpec, None, ProfileSpec.mapping, lambda m: m)]


# --- splits -------------------------------------------------------------------------------------


class SplitMatch(Section):
    """``splits[].match:``: every condition given must hold."""

    model: str | None = option(None, "model name glob")
    headers: dict[str, str] = option({}, "header values (exact)")
    cookies: dict[str, str] = option({}, "cookie values (exact)")
    query: dict[str, str] = option({}, "query parameter values (exact)")


class SplitTargetEntry(Section):
    """One arm of a split: the model name written into the request body."""

    model: str = Field(description="the model (or adapter) served to this arm", min_length=1)
    weight: float = option(1.0, "its share, relative to the rule's other targets", ge=0)
    pool: str | None = option(None, "confine the arm to replicas labelled pool=LABEL")


class SplitEntry(Section):
    """One item of ``splits:``, first match wins; the arm is hashed on the session (else user, else request)."""

    name: str | None = option(None, "as metrics name it (default: split-INDEX)")
    match: SplitMatch = option(SplitMatch(), "which requests it takes")
    targets: list[SplitTargetEntry] = Field(description="weighted arms", min_length=1)
    pin_header: str = option("x-canary", "a request naming a target model here is pinned to that arm", min_length=1)

    @model_validator(mode="after")
    def _targets(self) -> SplitEntry:
        if sum(t.weight for t in self.targets) <= 0:
            raise field_error(SplitEntry, "targets", "the weights must not all be zero", None)
        models = [t.model for t in self.targets]
        if len(set(models)) != len(models):
            raise field_error(SplitEntry, "targets", "each target names a different model", None)
        return self

    def rule(self) -> SplitRule:
        """The split as the request layer applies it (unnamed: named after its index by the config)."""
        m = self.match
        return SplitRule(
            name=self.name or "",
            targets=tuple(SplitTarget(t.model, t.weight, t.pool) for t in self.targets),
            model=m.model,
            headers={k.lower(): v for k, v in m.headers.items()},
            cookies=dict(m.cookies),
            query=dict(m.query),
            pin_header=self.pin_header.lower(),
        )


def _split_entry(rule: SplitRule) -> dict[str, Any]:
    match = {"model": rule.model, "headers": dict(rule.headers), "cookies": dict(rule.cookies), "query": rule.query}
    targets = [{"model": t.model, "weight": t.weight, "pool": t.pool} for t in rule.targets]
    return {"name": rule.name, "match": match, "targets": targets, "pin_header": rule.pin_header}


SplitItem = Annotated[SplitRule, held_as(SplitEntry, SplitRule, SplitEntry.rule, _split_entry)]


# --- the root -----------------------------------------------------------------------------------


class Config(Section):
    """The whole file, and the router's runtime config. Every key is optional: ``extproc serve
    --replica ...`` runs without one."""

    listen: str = option("127.0.0.1:9002", "the ext_proc gRPC listener: HOST:PORT or unix:/path")
    mode: Mode = option("cluster", "cluster: a target-cluster header; endpoint: GIE's destination-endpoint header")
    headers: Headers = option(Headers(), "routing header names")
    replicas: tuple[ReplicaItem, ...] = option((), "static replicas (discovery may add more)", strict=False)
    discovery: DiscoverySettings = option(
        StaticSource(), "where members come from: type static (default), dns or kubernetes; see docs/configuration.md"
    )
    workers: int = option(1, "processes serving the ext_proc port, sharing state in memory (docs/performance.md)", ge=1)
    store: str = option(
        "memory://", "affinity store URL: memory://, redis://, rediss://, unix://, redis+sentinel://, ..."
    )
    sessions: Sessions = option(Sessions(), "session pins")
    request: Request = option(Request(), "session sources and body size")
    prefix: Prefix = option(Prefix(), "prefix hashing and index")
    ring: Ring = option(Ring(), "the consistent-hash ring")
    metrics: Metrics = option(Metrics(), "Prometheus /metrics")
    grpc: Grpc = option(Grpc(), "the gRPC listener")
    admin: AdminSettings = option(
        AdminSettings(), "the admin API, on the ext_proc port unless given its own (docs/ports.md)"
    )
    health: HealthSettings = option(HealthSettings(), "replica health and rotation")
    spillover: Spillover = option(Spillover(), "overloaded replicas")
    disaggregation: Disaggregation = option(Disaggregation(), "prefill/decode pairs, where replicas carry roles")
    upstream: UpstreamTimeouts = option(UpstreamTimeouts(), "how long Envoy waits for a replica")
    kv_events: KvEventSettings = option(KvEventSettings(), "vLLM's KV-cache events")
    rebalance: RebalanceSettings = option(RebalanceSettings(), "moving sessions")
    tenants: TenantSettings = option(TenantSettings(), "tenants and quotas")
    classes: tuple[ClassItem, ...] = option((), "request classes, first match wins", strict=False)
    profile: ProfileMapping = option(DEFAULT_PROFILE, "the routing profile (default: the shipped one)")
    profiles: dict[str, ProfileMapping] = option({}, "named profiles that classes may use")
    splits: tuple[SplitItem, ...] = option(
        (), "canary and A/B splits with model rewrites, first match wins", strict=False
    )
    queueing: QueueSettings = option(QueueSettings(), "priority and fair queueing when the fleet is full")
    hot_keys: HotKeySettings = option(HotKeySettings(), "hot-prefix detection and replication")
    tracing: TracingSettings = option(TracingSettings(), "OpenTelemetry spans of routing decisions")
    budgets: BudgetSettings = option(BudgetSettings(), "token metering; token budgets per tenant, API key and model")

    @field_validator("store")
    @classmethod
    def _store_url(cls, url: str) -> str:
        parse_store_url(url)  # the form only: Redis may well be down while we start
        return url

    @field_validator("splits")
    @classmethod
    def _split_names(cls, rules: tuple[SplitRule, ...]) -> tuple[SplitRule, ...]:
        named = tuple(r if r.name else dataclasses.replace(r, name=f"split-{i}") for i, r in enumerate(rules))
        names = [r.name for r in named]
        if len(set(names)) != len(names):
            raise ValueError("rule names must be unique")
        return named

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        # Checks whose messages carry their own paths (describe prints them as they are).
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("replicas: names must be unique")
        for i, rule in enumerate(self.classes):
            if rule.profile is not None and rule.profile not in self.profiles:
                raise ValueError(f"classes[{i}].profile: no profile {rule.profile!r} under profiles:")
        try:
            build_profile(self.profile)  # fail now, naming the field, rather than at the first request
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        for name, spec in self.profiles.items():
            try:
                build_profile(spec)
            except ProfileError as exc:
                raise ValueError(f"profiles.{name}: {exc}") from None
        return self

    @cached_property
    def features(self) -> FeatureSettings:
        """What feature extraction reads, gathered once from ``request:``, ``prefix:``,
        ``tenants:`` and ``classes:`` (the request layer sees no config)."""
        return FeatureSettings(
            session_sources=self.request.session_sources,
            # A client's claim is no identity: the header counts only when the gateway sets it.
            tenant_header=self.tenants.header if self.tenants.trust_header else "",
            block_chars=self.prefix.block_chars,
            max_blocks=self.prefix.max_blocks,
            max_body_bytes=self.request.max_body_bytes,
            conversations=self.request.conversations,
            api_keys=self.tenants.api_keys,
            classes=self.classes,
            tenant_objectives={
                name: p.objectives
                for name, p in self.tenants.definitions.items()
                if p.objectives is not None and not p.objectives.empty
            },
        )

    @property
    def routing_headers(self) -> tuple[str, ...]:
        """Headers a client must never set itself (the prefill replica's among them: a client naming
        one would have the decode replica's sidecar send its prompt anywhere)."""
        return (
            self.headers.target_cluster,
            self.headers.destination_endpoint,
            self.upstream.stream_header,
            PREFILLER_HEADER,
        )

    @property
    def identity_headers(self) -> tuple[str, ...]:
        """Headers that say who a request is (the tenant's): a rendered Envoy config strips a
        client's before any filter, so only the gateway's own authentication can set them."""
        return (self.tenants.header,)
