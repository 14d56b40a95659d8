"""Discovery settings (config ``discovery:``): where the replica list comes from.

One model per source kind, told apart by ``type`` (a discriminated union); every kind also has
the two debounce keys::

    discovery: {type: static}                                           # the default
    discovery: {type: dns, name: vllm.ns.svc.cluster.local, port: 8000, record: A, interval_s: 10}
    discovery: {type: dns, name: _http._tcp.vllm.ns.svc.cluster.local, record: SRV}
    discovery: {type: kubernetes, namespace: llm, service: vllm, port_name: http}
    discovery: {type: inference_pool, name: vllm, namespace: llm}     # GIE's InferencePool v1

A new list is applied once it has been stable for ``debounce_s`` (so an endpoint flapping faster
than that causes no churn), but never later than ``max_delay_s`` after the first unapplied
change (so a fleet where something always flaps still converges).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from extproc.base.validation import Section, field_error, option

DnsRecord = Literal["A", "AAAA", "SRV"]
AddressType = Literal["IPv4", "IPv6"]

DEBOUNCE_S = 1.0
MAX_DELAY_S = 10.0
# Below the 5 minutes after which proxies and load balancers in front of API servers tend to cut
# idle streams; the server ends the watch, and we resume it from the last resourceVersion.
WATCH_TIMEOUT_S = 240
_NAME = r"\S"  # a non-empty name


class _Debounced(Section):
    """What every source shares: how changes are debounced before they reach the router."""

    debounce_s: float = option(DEBOUNCE_S, "a new list is applied once stable this long", ge=0)
    max_delay_s: float = option(
        MAX_DELAY_S,
        "...but never later than this after the first unapplied change (default: at least debounce_s)",
        ge=0,
    )

    @model_validator(mode="before")
    @classmethod
    def _delay_follows_debounce(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping) and "max_delay_s" not in raw and isinstance(raw.get("debounce_s"), int | float):
            return {**raw, "max_delay_s": max(MAX_DELAY_S, raw["debounce_s"])}
        return raw

    @model_validator(mode="after")
    def _ordered(self) -> _Debounced:
        if self.max_delay_s < self.debounce_s:
            raise field_error(type(self), "max_delay_s", "must not be below discovery.debounce_s", self.max_delay_s)
        return self

    @property
    def is_static(self) -> bool:
        """True when the replicas come from the config only."""
        return False


class StaticSource(_Debounced):
    """The replicas of the config (``replicas:`` or ``--replica``), and nothing else."""

    type: Literal["static"] = option("static", "static (the config's replicas), dns or kubernetes")

    @property
    def is_static(self) -> bool:
        """True when the replicas come from the config only."""
        return True


class DnsSource(_Debounced):
    """A headless service resolved every ``interval_s``.

    ``A``/``AAAA``: every address is a replica at ``port``. ``SRV``: every record's target is
    resolved (A, else AAAA) and its port comes from the record, so ``port`` is not given.
    """

    type: Literal["dns"] = "dns"
    name: str = Field(description="the name resolved", pattern=_NAME)
    port: int | None = option(None, "the replicas' port (A, AAAA; SRV records carry theirs)", ge=1, le=65535)
    record: DnsRecord = option("A", "A, AAAA or SRV")
    interval_s: float = option(10.0, "resolved this often", ge=0.01)
    timeout_s: float = option(2.0, "a lookup slower than this failed", ge=0.001)

    @model_validator(mode="after")
    def _port_by_record(self) -> DnsSource:
        if self.record == "SRV" and self.port is not None:
            raise field_error(DnsSource, "port", "not used with record SRV (the records carry the ports)", self.port)
        if self.record != "SRV" and self.port is None:
            raise field_error(DnsSource, "port", f"required with record {self.record}", None)
        return self


class KubernetesSource(_Debounced):
    """The EndpointSlices of one Service, listed then watched.

    ``namespace`` None means the pod's own namespace (from its service account), else
    ``default``. The port is ``port`` (a number), or the slice port named ``port_name``, or the
    slice's only port when neither is given.
    """

    type: Literal["kubernetes"] = "kubernetes"
    service: str = Field(description="the Service whose EndpointSlices are followed", pattern=_NAME)
    namespace: str | None = option(None, "its namespace (default: the pod's own)", pattern=_NAME)
    port: int | None = option(None, "the replicas' port number", ge=1, le=65535)
    port_name: str | None = option(None, "...or the slice port of this name", pattern=_NAME)
    address_type: AddressType = option("IPv4", "IPv4 or IPv6 slices")
    kubeconfig: str | None = option(None, "a kubeconfig file (default: in-cluster)", pattern=_NAME)
    context: str | None = option(None, "its context", pattern=_NAME)
    watch_timeout_s: int = option(WATCH_TIMEOUT_S, "a watch is resumed this often", ge=1)

    @model_validator(mode="after")
    def _one_port(self) -> KubernetesSource:
        if self.port is not None and self.port_name is not None:
            raise field_error(KubernetesSource, "port_name", "give port or port_name, not both", self.port_name)
        return self


class InferencePoolSource(_Debounced):
    """An InferencePool (``inference.networking.k8s.io/v1``) and the pods it selects, listed then
    watched: the processor as the pool's endpoint picker (``--pool-name``, ``--pool-namespace``,
    as GIE's picker takes them). The pods' port is the pool's ``targetPorts``; their labels
    (``llm-d.ai/role`` among them) are the replicas'. ``namespace`` None means the pod's own."""

    type: Literal["inference_pool"] = "inference_pool"
    # A pod's readiness already went through kubelet's probe thresholds: a picker that waited
    # longer would send to a pod the gateway has stopped offering. So 0, as GIE's picker does.
    debounce_s: float = option(0.0, "a new list is applied once stable this long", ge=0)
    name: str = Field(description="the InferencePool followed", pattern=_NAME)
    namespace: str | None = option(None, "its namespace (default: the pod's own)", pattern=_NAME)
    kubeconfig: str | None = option(None, "a kubeconfig file (default: in-cluster)", pattern=_NAME)
    context: str | None = option(None, "its context", pattern=_NAME)
    watch_timeout_s: int = option(WATCH_TIMEOUT_S, "a watch is resumed this often", ge=1)


SOURCE_KINDS = ("static", "dns", "kubernetes", "inference_pool")


def _static_by_default(raw: Any) -> Any:
    if raw is None:
        return {"type": "static"}
    if isinstance(raw, Mapping) and "type" not in raw:
        return {**raw, "type": "static"}
    return raw


DiscoverySettings = Annotated[
    StaticSource | DnsSource | KubernetesSource | InferencePoolSource,
    Field(discriminator="type"),
    BeforeValidator(_static_by_default),
]
"""Config ``discovery:``: one of the sources, by ``type`` (static when absent)."""
