"""The router's configuration: one YAML file, validated at start-up with messages that name the field.

Every value has a default, so ``extproc serve --replica a=127.0.0.1:8001`` works without a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from extproc.discovery.settings import DiscoveryConfigError, DiscoverySettings, parse_discovery
from extproc.health.rotation import RotationPolicy
from extproc.health.score import HealthLimits, HealthWeights
from extproc.health.settings import HealthSettings
from extproc.hotkeys.detector import HotKeySettings
from extproc.kvevents.hashing import HashAlgo
from extproc.kvevents.settings import KvEventSettings
from extproc.queueing.settings import QueueClass, QueueSettings
from extproc.rebalance.prewarm import PrewarmSettings
from extproc.rebalance.rebalancer import RebalanceSettings
from extproc.request.classes import ClassRule
from extproc.request.features import FeatureSettings
from extproc.request.session import SessionSource
from extproc.request.splits import SplitRule, SplitTarget
from extproc.routing.model import Replica
from extproc.routing.registry import DEFAULT_PROFILE, ProfileError, build_profile
from extproc.state.store_url import parse_store_url
from extproc.tenancy import TenantPolicy, TenantSettings
from extproc.upstream_timeouts import UpstreamTimeouts

if TYPE_CHECKING:
    import extproc.config_schema as schema

Mode = Literal["cluster", "endpoint"]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class ListenerTls:
    """TLS on the processor's gRPC listener (config ``grpc.tls``, or ``--tls-cert``/``--tls-key``).

    Files only, never inline PEM, so the key stays out of config files and process listings. With
    ``client_ca_file`` it is mutual TLS: a client must present a certificate that CA signed.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        """Whether client certificates are required."""
        return self.client_ca_file is not None


@dataclass(frozen=True, slots=True)
class AdminSettings:
    """The admin API (config ``admin:``, ``--admin-listen``): on the ext_proc port by default
    (``listen`` None), on a port of its own with ``listen``, not at all without ``enabled``."""

    enabled: bool = True
    listen: str | None = None
    token_file: str | None = None
    tls: ListenerTls | None = None
    watch_sample_rate: float = 0.1


@dataclass(frozen=True, slots=True)
class Config:
    """Validated router configuration."""

    listen: str = "127.0.0.1:9002"
    mode: Mode = "cluster"
    target_cluster_header: str = "x-target-cluster"
    destination_endpoint_header: str = "x-gateway-destination-endpoint"
    replicas: tuple[Replica, ...] = ()
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    store: str = "memory://"
    workers: int = 1
    session_ttl_s: float = 600.0
    max_sessions: int = 100_000
    blocks_per_replica: int = 31_250
    features: FeatureSettings = field(default_factory=FeatureSettings)
    profile: Mapping[str, Any] = field(default_factory=lambda: DEFAULT_PROFILE)
    vnodes: int = 128
    ring_key_blocks: int = 32
    metrics_listen: str | None = "127.0.0.1:9190"
    max_message_bytes: int = 32 * 1024 * 1024
    health: HealthSettings = field(default_factory=HealthSettings)
    rebalance: RebalanceSettings = field(default_factory=RebalanceSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    spillover_repin: bool = False
    grace_s: float = 5.0
    grpc_tls: ListenerTls | None = None
    # A plaintext listener that serves only the gRPC health service (kubelet's gRPC probes speak
    # plaintext, so with grpc.tls they need one); None: health is served on `listen` only.
    health_listen: str | None = None
    upstream: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    splits: tuple[SplitRule, ...] = ()
    queueing: QueueSettings = field(default_factory=QueueSettings)
    kv_events: KvEventSettings = field(default_factory=KvEventSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    hot_keys: HotKeySettings = field(default_factory=HotKeySettings)

    @property
    def routing_headers(self) -> tuple[str, ...]:
        """Headers a client must never set itself."""
        return (self.target_cluster_header, self.destination_endpoint_header, self.upstream.stream_header)


def parse_replica(spec: str) -> Replica:
    """``NAME=HOST:PORT[,LABEL=VALUE...]`` (or just ``HOST:PORT``, named after its address)."""
    head, *label_specs = spec.split(",")
    name, sep, address = head.partition("=")
    if not sep:
        name, address = head.replace(":", "_").replace(".", "-"), head
    _check_address(address, f"replica {spec!r}")
    labels = {}
    for item in label_specs:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"replica {spec!r}: labels are LABEL=VALUE, got {item!r}")
        labels[key.strip()] = value.strip()
    return Replica(name=name.strip(), address=address.strip(), labels=labels)


def _check_address(address: str, where: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT, got {address!r}")


def checked_sample_rate(rate: float, where: str) -> float:
    """``health.response_sample_rate`` (or the flag ``where`` names), checked: a share from 0 to 1."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"{where}: expected a number from 0 to 1")
    return rate


def _health_settings(raw: schema.Health) -> HealthSettings:
    if raw.readmit_above < raw.eject_below:
        raise ConfigError("health.readmit_above: must not be below health.eject_below (hysteresis)")
    return HealthSettings(
        response_sample_rate=raw.response_sample_rate,
        scrape_interval_s=raw.scrape_interval_s,
        scrape_timeout_s=raw.scrape_timeout_s,
        stale_after_s=raw.stale_after_s,
        metrics_path=raw.metrics_path,
        weights=HealthWeights(**raw.weights.model_dump()),
        limits=HealthLimits(**raw.limits.model_dump()),
        rotation=RotationPolicy(
            eject_below=raw.eject_below,
            eject_after=raw.eject_after,
            readmit_above=raw.readmit_above,
            readmit_after=raw.readmit_after,
            cooldown_s=raw.cooldown_s,
        ),
        upstream_fail_after=raw.upstream_fail_after,
        ttft_window_s=raw.ttft_window_s,
    )


def _tenant_settings(raw: schema.Tenants) -> TenantSettings:
    return TenantSettings(
        definitions={name: TenantPolicy(**spec.model_dump()) for name, spec in raw.definitions.items()},
        replica_capacity=raw.replica_capacity,
        per_replica=raw.per_replica,
        overflow_pool=dict(raw.overflow_pool),
    )


def _api_keys(raw: schema.Tenants) -> dict[str, str]:
    """API-key digests -> tenant, inline or from a YAML/JSON file (``api_keys_file``)."""
    keys: dict[str, Any] = dict(raw.api_keys)
    if raw.api_keys_file:
        try:
            loaded = yaml.safe_load(Path(raw.api_keys_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"tenants.api_keys_file: {exc}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError("tenants.api_keys_file: expected a mapping of sha256 digest -> tenant")
        keys.update(loaded)
    for digest in keys:
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ConfigError("tenants.api_keys: keys are hex SHA-256 digests of API keys, never the keys themselves")
    return {k: str(v) for k, v in keys.items()}


def _class_rules(raw: Sequence[schema.ClassRuleSection], profiles: Mapping[str, Any]) -> tuple[ClassRule, ...]:
    rules = []
    for i, item in enumerate(raw):
        if item.profile is not None and item.profile not in profiles:
            raise ConfigError(f"classes[{i}].profile: no profile {item.profile!r} under profiles:")
        match = item.match
        models = match.models if isinstance(match.models, list) else [match.models]
        rules.append(
            ClassRule(
                name=item.name,
                min_tokens=match.min_tokens,
                max_tokens=match.max_tokens,
                stream=match.stream,
                media=match.media,
                headers={k.lower(): v for k, v in match.headers.items()},
                models=tuple(models),
                pool=dict(item.pool),
                profile=item.profile,
            )
        )
    return tuple(rules)


def _split_rules(raw: Sequence[schema.SplitRuleSection]) -> tuple[SplitRule, ...]:
    rules = []
    for i, item in enumerate(raw):
        if sum(t.weight for t in item.targets) <= 0:
            raise ConfigError(f"splits[{i}].targets: the weights must not all be zero")
        models = [t.model for t in item.targets]
        if len(set(models)) != len(models):
            raise ConfigError(f"splits[{i}].targets: each target names a different model")
        match = item.match
        rules.append(
            SplitRule(
                name=item.name or f"split-{i}",
                targets=tuple(SplitTarget(t.model, t.weight, t.pool) for t in item.targets),
                model=match.model,
                headers={k.lower(): v for k, v in match.headers.items()},
                cookies=dict(match.cookies),
                query=dict(match.query),
                pin_header=item.pin_header.lower(),
            )
        )
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ConfigError("splits: rule names must be unique")
    return tuple(rules)


def _queue_settings(raw: schema.Queueing) -> QueueSettings:
    return QueueSettings(
        **raw.model_dump(exclude={"default", "classes"}),
        default=QueueClass(**raw.default.model_dump()),
        classes={name: QueueClass(**c.model_dump()) for name, c in raw.classes.items()},
    )


def _profile_mapping(spec: schema.ProfileSpec) -> dict[str, Any]:
    return spec.model_dump(exclude_none=True)


def _profiles(raw: Mapping[str, schema.ProfileSpec]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for name, spec in raw.items():
        mapping = _profile_mapping(spec)
        try:
            build_profile(mapping)
        except ProfileError as exc:
            raise ConfigError(f"profiles.{name}: {exc}") from None
        out[name] = mapping
    return out


def _rebalance_settings(raw: schema.Rebalance) -> RebalanceSettings:
    fields = raw.model_dump(exclude={"prewarm"})
    return RebalanceSettings(**fields, prewarm=PrewarmSettings(**raw.prewarm.model_dump()))


def _upstream_timeouts(raw: schema.Upstream) -> UpstreamTimeouts:
    if 0 < raw.unary_max_s < raw.first_byte_s:
        # Below the first-byte budget every non-streaming request would be sent twice.
        raise ConfigError(
            f"upstream.unary_max_s: {raw.unary_max_s:g} s is below first_byte_s {raw.first_byte_s:g} s "
            "(a non-streaming answer comes after its prefill at the earliest)"
        )
    return UpstreamTimeouts(**{**raw.model_dump(), "stream_header": raw.stream_header.lower()})


def _discovery_settings(raw: Any) -> DiscoverySettings:
    try:
        return parse_discovery(raw)
    except DiscoveryConfigError as exc:
        raise ConfigError(str(exc)) from None


def _admin_settings(raw: schema.Admin) -> AdminSettings:
    tls = raw.tls
    if tls is not None and raw.enabled and raw.listen in (None, "off"):
        # On the ext_proc port the admin API is served with grpc.tls; admin.tls alone would be ignored.
        raise ConfigError("admin.tls: TLS of a separate admin listener, so set admin.listen too (see docs/ports.md)")
    return AdminSettings(
        enabled=raw.enabled and raw.listen != "off",
        listen=raw.listen if raw.listen != "off" else None,
        token_file=raw.token_file,
        tls=ListenerTls(tls.cert_file, tls.key_file, tls.client_ca_file) if tls is not None else None,
        watch_sample_rate=raw.watch_sample_rate,
    )


def config_from_mapping(raw: Mapping[str, Any]) -> Config:
    """Validate a parsed YAML mapping into a :class:`Config` (the schema: :mod:`extproc.config_schema`)."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    # Imported here: pydantic and the schema cost a start without a config file ~0.3 s.
    import extproc.config_schema as schema

    try:
        file = schema.parse_file(raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    replicas: list[Replica] = []
    for i, item in enumerate(file.replicas):
        _check_address(item.address, f"replicas[{i}].address")
        replicas.append(Replica(item.name, item.address, item.weight, _replica_labels(item, i)))
    names = [r.name for r in replicas]
    if len(set(names)) != len(names):
        raise ConfigError("replicas: names must be unique")
    try:
        sources = tuple(SessionSource.parse(s) for s in file.request.session_sources)
    except ValueError as exc:
        raise ConfigError(f"request.session_sources: {exc}") from None
    profiles = _profiles(file.profiles)
    features = FeatureSettings(
        session_sources=sources,
        tenant_header=file.tenants.header.lower(),
        block_chars=file.prefix.block_chars,
        max_blocks=file.prefix.max_blocks,
        max_body_bytes=file.request.max_body_bytes,
        api_keys=_api_keys(file.tenants),
        classes=_class_rules(file.classes, profiles),
    )
    tls = file.grpc.tls
    cfg = Config(
        listen=file.listen,
        mode=file.mode,
        target_cluster_header=file.headers.target_cluster.lower(),
        destination_endpoint_header=file.headers.destination_endpoint.lower(),
        replicas=tuple(replicas),
        discovery=_discovery_settings(file.discovery),
        store=file.store,
        workers=file.workers,
        session_ttl_s=file.sessions.ttl_s,
        max_sessions=file.sessions.max_sessions,
        blocks_per_replica=file.prefix.blocks_per_replica,
        features=features,
        profile=_profile_mapping(file.profile) if file.profile is not None else DEFAULT_PROFILE,
        vnodes=file.ring.vnodes,
        ring_key_blocks=file.ring.key_blocks,
        metrics_listen=file.metrics.listen if file.metrics.enabled else None,
        max_message_bytes=file.grpc.max_message_bytes,
        grpc_tls=ListenerTls(tls.cert_file, tls.key_file, tls.client_ca_file) if tls is not None else None,
        health_listen=file.grpc.health_listen,
        health=_health_settings(file.health),
        rebalance=_rebalance_settings(file.rebalance),
        tenants=_tenant_settings(file.tenants),
        profiles=profiles,
        spillover_repin=file.spillover.repin,
        splits=_split_rules(file.splits),
        queueing=_queue_settings(file.queueing),
        upstream=_upstream_timeouts(file.upstream),
        kv_events=_kv_events(file.kv_events),
        admin=_admin_settings(file.admin),
        hot_keys=HotKeySettings(**file.hot_keys.model_dump()),
    )
    try:
        parse_store_url(cfg.store)  # the form only: Redis may well be down while we start
    except ValueError as exc:
        raise ConfigError(f"store: {exc}") from None
    try:
        build_profile(cfg.profile)  # fail now, naming the field, rather than at the first request
    except ProfileError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


REPLICA_KV_FIELDS = ("kv_events", "kv_replay", "kv_dp")
"""A ``replicas:`` entry's KV-event fields: the labels a ``--replica`` flag carries them in."""


def _replica_labels(item: schema.ReplicaEntry, i: int) -> dict[str, str]:
    """An entry's labels, with its KV-event fields as the labels the subscriptions read."""
    labels = dict(item.labels)
    for key in REPLICA_KV_FIELDS:
        value = getattr(item, key)
        if value is None:
            continue
        if key in labels and labels[key] != str(value):
            raise ConfigError(f"replicas[{i}].{key}: {value!r}, but labels.{key} says {labels[key]!r}")
        labels[key] = str(value)
    if "kv_replay" in labels and "kv_events" not in labels:
        raise ConfigError(f"replicas[{i}].kv_replay: needs kv_events (the publisher it replays)")
    return labels


def _kv_events(raw: schema.KvEvents) -> KvEventSettings:
    return KvEventSettings(
        **raw.model_dump(exclude={"hash_algo", "hash_seed"}),
        hash_algo=HashAlgo(raw.hash_algo),
        hash_seed=None if raw.hash_seed is None else str(raw.hash_seed),
    )


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config_from_mapping(raw)


def with_overrides(cfg: Config, **changes: Any) -> Config:
    """A copy with some fields replaced (CLI flags win over the file)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
