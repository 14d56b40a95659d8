"""Discovery settings (config ``discovery:``): where the replica list comes from.

The YAML section is one flat mapping whose ``type`` picks the source; the other keys belong to
that source, plus the two debounce keys every source shares::

    discovery: {type: static}                                           # the default
    discovery: {type: dns, name: vllm.ns.svc.cluster.local, port: 8000, record: A, interval_s: 10}
    discovery: {type: dns, name: _http._tcp.vllm.ns.svc.cluster.local, record: SRV}
    discovery: {type: kubernetes, namespace: llm, service: vllm, port_name: http}

Parsing raises :class:`DiscoveryConfigError` naming the field (``discovery.port: ...``); the
config module turns it into its own ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

DnsRecord = Literal["A", "AAAA", "SRV"]
AddressType = Literal["IPv4", "IPv6"]

DEBOUNCE_S = 1.0
MAX_DELAY_S = 10.0
DNS_INTERVAL_S = 10.0
DNS_TIMEOUT_S = 2.0
# Below the 5 minutes after which proxies and load balancers in front of API servers tend to cut
# idle streams; the server ends the watch, and we resume it from the last resourceVersion.
WATCH_TIMEOUT_S = 240


class DiscoveryConfigError(ValueError):
    """The ``discovery:`` section is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class StaticSource:
    """The replicas of the config (``replicas:`` or ``--replica``), and nothing else."""

    type: Literal["static"] = "static"


@dataclass(frozen=True, slots=True)
class DnsSource:
    """A headless service resolved every ``interval_s``.

    ``A``/``AAAA``: every address is a replica at ``port``. ``SRV``: every record's target is
    resolved (A, else AAAA) and its port comes from the record, so ``port`` is not given.
    """

    name: str
    port: int | None = None
    record: DnsRecord = "A"
    interval_s: float = DNS_INTERVAL_S
    timeout_s: float = DNS_TIMEOUT_S
    type: Literal["dns"] = "dns"


@dataclass(frozen=True, slots=True)
class KubernetesSource:
    """The EndpointSlices of one Service, listed then watched.

    ``namespace`` None means the pod's own namespace (from its service account), else
    ``default``. The port is ``port`` (a number), or the slice port named ``port_name``, or the
    slice's only port when neither is given.
    """

    service: str
    namespace: str | None = None
    port: int | None = None
    port_name: str | None = None
    address_type: AddressType = "IPv4"
    kubeconfig: str | None = None
    context: str | None = None
    watch_timeout_s: int = WATCH_TIMEOUT_S
    type: Literal["kubernetes"] = "kubernetes"


Source = StaticSource | DnsSource | KubernetesSource


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """Which source, and how changes are debounced before they reach the router.

    A new list is applied once it has been stable for ``debounce_s`` (so an endpoint flapping
    faster than that causes no churn), but never later than ``max_delay_s`` after the first
    unapplied change (so a fleet where something always flaps still converges).
    """

    source: Source = field(default_factory=StaticSource)
    debounce_s: float = DEBOUNCE_S
    max_delay_s: float = MAX_DELAY_S

    @property
    def is_static(self) -> bool:
        """True when the replicas come from the config only."""
        return isinstance(self.source, StaticSource)


_COMMON = {"type", "debounce_s", "max_delay_s"}
_KEYS: dict[str, set[str]] = {
    "static": set(),
    "dns": {"name", "port", "record", "interval_s", "timeout_s"},
    "kubernetes": {
        "service",
        "namespace",
        "port",
        "port_name",
        "address_type",
        "kubeconfig",
        "context",
        "watch_timeout_s",
    },
}
W = "discovery"


def _str(raw: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise DiscoveryConfigError(f"{W}.{key}: required for type {raw.get('type')}")
        return None
    if not isinstance(value, str) or not value.strip():
        raise DiscoveryConfigError(f"{W}.{key}: expected a non-empty string, got {value!r}")
    return value.strip()


def _number(raw: Mapping[str, Any], key: str, default: float, minimum: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DiscoveryConfigError(f"{W}.{key}: expected a number, got {value!r}")
    if value < minimum:
        raise DiscoveryConfigError(f"{W}.{key}: expected a number >= {minimum:g}, got {value:g}")
    return float(value)


def _port(raw: Mapping[str, Any]) -> int | None:
    value = raw.get("port")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise DiscoveryConfigError(f"{W}.port: expected a port number 1-65535, got {value!r}")
    return value


def _choice(raw: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> Any:
    value = raw.get(key, choices[0])
    if value not in choices:
        raise DiscoveryConfigError(f"{W}.{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def parse_discovery(raw: Mapping[str, Any] | None) -> DiscoverySettings:
    """Validate the ``discovery:`` mapping (None or empty: static)."""
    if not raw:
        return DiscoverySettings()
    if not isinstance(raw, Mapping):
        raise DiscoveryConfigError(f"{W}: expected a mapping")
    kind = raw.get("type", "static")
    if kind not in _KEYS:
        raise DiscoveryConfigError(f"{W}.type: expected static, dns or kubernetes, got {kind!r}")
    unknown = set(raw) - _COMMON - _KEYS[kind]
    if unknown:
        raise DiscoveryConfigError(f"{W}.{sorted(unknown)[0]}: not a key of discovery type {kind}")
    debounce_s = _number(raw, "debounce_s", DEBOUNCE_S, 0.0)
    max_delay_s = _number(raw, "max_delay_s", max(MAX_DELAY_S, debounce_s), 0.0)
    if max_delay_s < debounce_s:
        raise DiscoveryConfigError(f"{W}.max_delay_s: must not be below discovery.debounce_s")
    source: Source
    if kind == "dns":
        name = _str(raw, "name", required=True)
        assert name is not None
        record: DnsRecord = _choice(raw, "record", ("A", "AAAA", "SRV"))
        port = _port(raw)
        if record == "SRV" and port is not None:
            raise DiscoveryConfigError(f"{W}.port: not used with record SRV (the records carry the ports)")
        if record != "SRV" and port is None:
            raise DiscoveryConfigError(f"{W}.port: required with record {record}")
        source = DnsSource(
            name=name,
            port=port,
            record=record,
            interval_s=_number(raw, "interval_s", DNS_INTERVAL_S, 0.01),
            timeout_s=_number(raw, "timeout_s", DNS_TIMEOUT_S, 0.001),
        )
    elif kind == "kubernetes":
        service = _str(raw, "service", required=True)
        assert service is not None
        port = _port(raw)
        port_name = _str(raw, "port_name")
        if port is not None and port_name is not None:
            raise DiscoveryConfigError(f"{W}.port_name: give port or port_name, not both")
        source = KubernetesSource(
            service=service,
            namespace=_str(raw, "namespace"),
            port=port,
            port_name=port_name,
            address_type=_choice(raw, "address_type", ("IPv4", "IPv6")),
            kubeconfig=_str(raw, "kubeconfig"),
            context=_str(raw, "context"),
            watch_timeout_s=int(_number(raw, "watch_timeout_s", WATCH_TIMEOUT_S, 1)),
        )
    else:
        source = StaticSource()
    return DiscoverySettings(source=source, debounce_s=debounce_s, max_delay_s=max_delay_s)
