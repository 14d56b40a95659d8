"""The router's configuration: one YAML file, validated at start-up with messages that name the field.

Every value has a default, so ``extproc serve --replica a=127.0.0.1:8001`` works without a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from extproc.discovery.settings import DiscoveryConfigError, DiscoverySettings, parse_discovery
from extproc.health.rotation import RotationPolicy
from extproc.health.score import HealthLimits, HealthWeights
from extproc.health.settings import HealthSettings
from extproc.kvevents.settings import KvEventSettings, kv_event_settings
from extproc.rebalance.prewarm import PrewarmSettings
from extproc.rebalance.rebalancer import RebalanceSettings
from extproc.request.classes import ClassRule
from extproc.request.features import FeatureSettings
from extproc.request.session import SessionSource
from extproc.routing.model import Replica
from extproc.routing.registry import DEFAULT_PROFILE, ProfileError, build_profile
from extproc.state.store_url import parse_store_url
from extproc.tenancy import TenantPolicy, TenantSettings

Mode = Literal["cluster", "endpoint"]
ROUTING_HEADERS = ("x-target-cluster", "x-gateway-destination-endpoint")


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
class Config:
    """Validated router configuration."""

    listen: str = "127.0.0.1:9002"
    mode: Mode = "cluster"
    target_cluster_header: str = "x-target-cluster"
    destination_endpoint_header: str = "x-gateway-destination-endpoint"
    replicas: tuple[Replica, ...] = ()
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    store: str = "memory://"
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
    kv_events: KvEventSettings = field(default_factory=KvEventSettings)

    @property
    def routing_headers(self) -> tuple[str, ...]:
        """Headers a client must never set itself."""
        return (self.target_cluster_header, self.destination_endpoint_header)


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


def _get(section: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any) -> Any:
    if key not in section:
        return default
    value = section[key]
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else ()):
        raise ConfigError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got a boolean")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping")
    return value


def _number(section: Mapping[str, Any], key: str, where: str, default: float, minimum: float = 0.0) -> float:
    value = float(_get(section, key, (int, float), where, default))
    if value < minimum:
        raise ConfigError(f"{where}.{key}: expected a number >= {minimum:g}, got {value:g}")
    return value


def checked_sample_rate(rate: float, where: str) -> float:
    """``health.response_sample_rate`` (or the flag ``where`` names), checked: a share from 0 to 1."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"{where}: expected a number from 0 to 1")
    return rate


def _health_settings(raw: Mapping[str, Any]) -> HealthSettings:
    d = HealthSettings()
    weights = _section(raw, "weights") if "weights" in raw else {}
    limits = _section(raw, "limits") if "limits" in raw else {}
    where = "health"
    rotation = RotationPolicy(
        eject_below=_number(raw, "eject_below", where, d.rotation.eject_below),
        eject_after=int(_number(raw, "eject_after", where, d.rotation.eject_after, 1)),
        readmit_above=_number(raw, "readmit_above", where, d.rotation.readmit_above),
        readmit_after=int(_number(raw, "readmit_after", where, d.rotation.readmit_after, 1)),
        cooldown_s=_number(raw, "cooldown_s", where, d.rotation.cooldown_s),
    )
    if rotation.readmit_above < rotation.eject_below:
        raise ConfigError("health.readmit_above: must not be below health.eject_below (hysteresis)")
    return HealthSettings(
        response_sample_rate=checked_sample_rate(
            _number(raw, "response_sample_rate", where, d.response_sample_rate), "health.response_sample_rate"
        ),
        scrape_interval_s=_number(raw, "scrape_interval_s", where, d.scrape_interval_s, 0.01),
        scrape_timeout_s=_number(raw, "scrape_timeout_s", where, d.scrape_timeout_s, 0.001),
        stale_after_s=_number(raw, "stale_after_s", where, d.stale_after_s, 0.01),
        metrics_path=str(_get(raw, "metrics_path", str, where, d.metrics_path)),
        weights=HealthWeights(
            **{
                k: _number(weights, k, "health.weights", getattr(d.weights, k))
                for k in HealthWeights.__dataclass_fields__
            }
        ),
        limits=HealthLimits(
            queue_full=int(_number(limits, "queue_full", "health.limits", d.limits.queue_full, 1)),
            kv_start=_number(limits, "kv_start", "health.limits", d.limits.kv_start),
            ttft_slo_s=_number(limits, "ttft_slo_s", "health.limits", d.limits.ttft_slo_s, 0.001),
            error_rate_full=_number(limits, "error_rate_full", "health.limits", d.limits.error_rate_full, 0.001),
            unreachable_after=int(_number(limits, "unreachable_after", "health.limits", d.limits.unreachable_after, 1)),
        ),
        rotation=rotation,
        upstream_fail_after=int(_number(raw, "upstream_fail_after", where, d.upstream_fail_after, 1)),
        ttft_window_s=_number(raw, "ttft_window_s", where, d.ttft_window_s, 1.0),
    )


TENANT_KEYS = {"header", "api_keys", "api_keys_file", "replica_capacity", "per_replica", "overflow_pool", "definitions"}


def _tenant_settings(raw: Mapping[str, Any]) -> TenantSettings:
    d = TenantSettings()
    unknown = set(raw) - TENANT_KEYS
    if unknown:
        raise ConfigError(f"tenants: unknown keys {', '.join(sorted(unknown))}")
    definitions: dict[str, TenantPolicy] = {}
    defs = _section(raw, "definitions") if "definitions" in raw else {}
    for name, spec in defs.items():
        where = f"tenants.definitions.{name}"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        over = spec.get("over_quota", "reject")
        if over not in ("reject", "overflow"):
            raise ConfigError(f"{where}.over_quota: expected 'reject' or 'overflow', got {over!r}")
        max_concurrent = spec.get("max_concurrent")
        share = spec.get("max_share")
        if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
            raise ConfigError(f"{where}.max_concurrent: expected an integer >= 1")
        if share is not None and (not isinstance(share, int | float) or not 0 < share <= 1):
            raise ConfigError(f"{where}.max_share: expected a fraction in (0, 1]")
        definitions[str(name)] = TenantPolicy(
            max_concurrent=max_concurrent,
            max_share=float(share) if share is not None else None,
            shard_size=int(_number(spec, "shard_size", where, 0)),
            over_quota=over,
            retry_after_s=int(_number(spec, "retry_after_s", where, 1, 1)),
        )
    pool = _get(raw, "overflow_pool", Mapping, "tenants", d.overflow_pool)
    return TenantSettings(
        definitions=definitions,
        replica_capacity=int(_number(raw, "replica_capacity", "tenants", d.replica_capacity, 1)),
        per_replica=int(_number(raw, "per_replica", "tenants", d.per_replica, 1)),
        overflow_pool={str(k): str(v) for k, v in pool.items()},
    )


def _api_keys(raw: Mapping[str, Any]) -> dict[str, str]:
    """API-key digests -> tenant, inline or from a YAML/JSON file (``api_keys_file``)."""
    keys: dict[str, Any] = dict(_get(raw, "api_keys", Mapping, "tenants", {}))
    path = raw.get("api_keys_file")
    if path:
        try:
            loaded = yaml.safe_load(Path(str(path)).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"tenants.api_keys_file: {exc}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError("tenants.api_keys_file: expected a mapping of sha256 digest -> tenant")
        keys.update(loaded)
    for digest in keys:
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ConfigError("tenants.api_keys: keys are hex SHA-256 digests of API keys, never the keys themselves")
    return {k: str(v) for k, v in keys.items()}


def _class_rules(raw: Any, profiles: Mapping[str, Any]) -> tuple[ClassRule, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("classes: expected a list of rules")
    rules = []
    for i, item in enumerate(raw):
        where = f"classes[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ConfigError(f"{where}: expected a mapping with a name")
        match = _section(item, "match") if "match" in item else {}
        unknown = set(match) - {"min_tokens", "max_tokens", "stream", "media", "headers", "models"}
        if unknown:
            raise ConfigError(f"{where}.match: unknown keys {', '.join(sorted(unknown))}")
        profile = item.get("profile")
        if profile is not None and profile not in profiles:
            raise ConfigError(f"{where}.profile: no profile {profile!r} under profiles:")
        models = match.get("models", [])
        rules.append(
            ClassRule(
                name=item["name"],
                min_tokens=_get(match, "min_tokens", int, f"{where}.match", None),
                max_tokens=_get(match, "max_tokens", int, f"{where}.match", None),
                stream=_get(match, "stream", bool, f"{where}.match", None),
                media=_get(match, "media", bool, f"{where}.match", None),
                headers={str(k).lower(): str(v) for k, v in _get(match, "headers", Mapping, where, {}).items()},
                models=tuple(str(m) for m in (models if isinstance(models, list) else [models])),
                pool={str(k): str(v) for k, v in _get(item, "pool", Mapping, where, {}).items()},
                profile=profile,
            )
        )
    return tuple(rules)


def _profiles(raw: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out = {}
    for name, spec in raw.items():
        try:
            build_profile(spec)
        except ProfileError as exc:
            raise ConfigError(f"profiles.{name}: {exc}") from None
        out[str(name)] = spec
    return out


def _rebalance_settings(raw: Mapping[str, Any]) -> RebalanceSettings:
    d = RebalanceSettings()
    where = "rebalance"
    pw = _section(raw, "prewarm") if "prewarm" in raw else {}
    fraction = _number(raw, "shed_fraction", where, d.shed_fraction)
    if fraction > 1:
        raise ConfigError("rebalance.shed_fraction: expected a fraction in [0, 1]")
    return RebalanceSettings(
        enabled=bool(_get(raw, "enabled", bool, where, d.enabled)),
        move_on_join=bool(_get(raw, "move_on_join", bool, where, d.move_on_join)),
        session_cooldown_s=_number(raw, "session_cooldown_s", where, d.session_cooldown_s),
        hot_kv=_number(raw, "hot_kv", where, d.hot_kv),
        hot_queue=int(_number(raw, "hot_queue", where, d.hot_queue)),
        hot_for_s=_number(raw, "hot_for_s", where, d.hot_for_s),
        shed_fraction=fraction,
        replica_cooldown_s=_number(raw, "replica_cooldown_s", where, d.replica_cooldown_s),
        ledger_sessions=int(_number(raw, "ledger_sessions", where, d.ledger_sessions, 1)),
        ledger_bytes=int(_number(raw, "ledger_bytes", where, d.ledger_bytes, 1)),
        prewarm=PrewarmSettings(
            enabled=bool(_get(pw, "enabled", bool, "rebalance.prewarm", d.prewarm.enabled)),
            rate_per_s=_number(pw, "rate_per_s", "rebalance.prewarm", d.prewarm.rate_per_s, 0.001),
            burst=int(_number(pw, "burst", "rebalance.prewarm", d.prewarm.burst, 1)),
            queue=int(_number(pw, "queue", "rebalance.prewarm", d.prewarm.queue, 1)),
            timeout_s=_number(pw, "timeout_s", "rebalance.prewarm", d.prewarm.timeout_s, 0.001),
        ),
    )


def _listener_tls(grpc: Mapping[str, Any]) -> ListenerTls | None:
    if "tls" not in grpc:
        return None
    raw = grpc["tls"]
    if not isinstance(raw, Mapping):
        raise ConfigError("grpc.tls: expected a mapping with cert_file and key_file")
    unknown = set(raw) - {"cert_file", "key_file", "client_ca_file"}
    if unknown:
        raise ConfigError(f"grpc.tls: unknown keys {', '.join(sorted(unknown))} (PEM is read from files only)")
    cert = _get(raw, "cert_file", str, "grpc.tls", None)
    key = _get(raw, "key_file", str, "grpc.tls", None)
    if not cert or not key:
        raise ConfigError("grpc.tls: cert_file and key_file are both required")
    return ListenerTls(cert, key, _get(raw, "client_ca_file", str, "grpc.tls", None) or None)


def _discovery_settings(raw: Any) -> DiscoverySettings:
    try:
        return parse_discovery(raw)
    except DiscoveryConfigError as exc:
        raise ConfigError(str(exc)) from None


KNOWN_KEYS = {
    "listen",
    "mode",
    "headers",
    "replicas",
    "discovery",
    "store",
    "sessions",
    "prefix",
    "request",
    "profile",
    "ring",
    "metrics",
    "grpc",
    "health",
    "spillover",
    "rebalance",
    "tenants",
    "classes",
    "profiles",
    "kv_events",
}


def config_from_mapping(raw: Mapping[str, Any]) -> Config:
    """Validate a parsed YAML mapping into a :class:`Config`."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    unknown = set(raw) - KNOWN_KEYS
    if unknown:
        raise ConfigError(f"unknown top-level keys: {', '.join(sorted(unknown))}")
    base = Config()
    mode = raw.get("mode", base.mode)
    if mode not in ("cluster", "endpoint"):
        raise ConfigError(f"mode: expected 'cluster' or 'endpoint', got {mode!r}")
    headers = _section(raw, "headers")
    replicas: list[Replica] = []
    for i, item in enumerate(raw.get("replicas") or []):
        where = f"replicas[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: expected a mapping with name and address")
        name = _get(item, "name", str, where, None)
        address = _get(item, "address", str, where, None)
        if not name or not address:
            raise ConfigError(f"{where}: name and address are required")
        _check_address(address, f"{where}.address")
        weight = float(_get(item, "weight", (int, float), where, 1.0))
        if weight <= 0:
            raise ConfigError(f"{where}.weight: expected a number > 0")
        labels = _get(item, "labels", Mapping, where, {})
        replicas.append(Replica(name, address, weight, {str(k): str(v) for k, v in labels.items()}))
    names = [r.name for r in replicas]
    if len(set(names)) != len(names):
        raise ConfigError("replicas: names must be unique")
    sessions = _section(raw, "sessions")
    prefix = _section(raw, "prefix")
    request = _section(raw, "request")
    ring = _section(raw, "ring")
    metrics = _section(raw, "metrics")
    grpc = _section(raw, "grpc")
    health = _section(raw, "health")
    sources_raw: Sequence[Any] = _get(request, "session_sources", list, "request", None) or []
    try:
        sources = tuple(SessionSource.parse(str(s)) for s in sources_raw)
    except ValueError as exc:
        raise ConfigError(f"request.session_sources: {exc}") from None
    fdefault = FeatureSettings()
    features = FeatureSettings(
        session_sources=sources or fdefault.session_sources,
        tenant_header=str(
            _get(_section(raw, "tenants"), "header", str, "tenants", None)
            or _get(request, "tenant_header", str, "request", fdefault.tenant_header)
        ).lower(),
        block_chars=int(_get(prefix, "block_chars", int, "prefix", fdefault.block_chars)),
        max_blocks=int(_get(prefix, "max_blocks", int, "prefix", fdefault.max_blocks)),
        max_body_bytes=int(_get(request, "max_body_bytes", int, "request", fdefault.max_body_bytes)),
        api_keys=_api_keys(_section(raw, "tenants")),
        classes=_class_rules(raw.get("classes"), _section(raw, "profiles")),
    )
    if features.block_chars < 1 or features.max_blocks < 1:
        raise ConfigError("prefix.block_chars and prefix.max_blocks: expected integers >= 1")
    profile = _section(raw, "profile") or DEFAULT_PROFILE
    cfg = Config(
        listen=str(_get(raw, "listen", str, "config", base.listen)),
        mode=mode,
        target_cluster_header=str(_get(headers, "target_cluster", str, "headers", base.target_cluster_header)).lower(),
        destination_endpoint_header=str(
            _get(headers, "destination_endpoint", str, "headers", base.destination_endpoint_header)
        ).lower(),
        replicas=tuple(replicas),
        discovery=_discovery_settings(raw.get("discovery")),
        store=str(_get(raw, "store", str, "config", base.store)),
        session_ttl_s=float(_get(sessions, "ttl_s", (int, float), "sessions", base.session_ttl_s)),
        max_sessions=int(_get(sessions, "max_sessions", int, "sessions", base.max_sessions)),
        blocks_per_replica=int(_get(prefix, "blocks_per_replica", int, "prefix", base.blocks_per_replica)),
        features=features,
        profile=profile,
        vnodes=int(_get(ring, "vnodes", int, "ring", base.vnodes)),
        ring_key_blocks=int(_get(ring, "key_blocks", int, "ring", base.ring_key_blocks)),
        metrics_listen=metrics.get("listen", base.metrics_listen) if metrics.get("enabled", True) else None,
        max_message_bytes=int(_get(grpc, "max_message_bytes", int, "grpc", base.max_message_bytes)),
        grpc_tls=_listener_tls(grpc),
        health_listen=_get(grpc, "health_listen", str, "grpc", None),
        health=_health_settings(health),
        rebalance=_rebalance_settings(_section(raw, "rebalance")),
        tenants=_tenant_settings(_section(raw, "tenants")),
        profiles=_profiles(_section(raw, "profiles")),
        spillover_repin=bool(_get(_section(raw, "spillover"), "repin", bool, "spillover", base.spillover_repin)),
        kv_events=_kv_events(raw.get("kv_events")),
    )
    if cfg.session_ttl_s <= 0 or cfg.max_sessions < 1:
        raise ConfigError("sessions.ttl_s and sessions.max_sessions: expected positive values")
    try:
        parse_store_url(cfg.store)  # the form only: Redis may well be down while we start
    except ValueError as exc:
        raise ConfigError(f"store: {exc}") from None
    try:
        build_profile(cfg.profile)  # fail now, naming the field, rather than at the first request
    except ProfileError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def _kv_events(raw: Any) -> KvEventSettings:
    try:
        return kv_event_settings(raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
