"""EndpointSlices to replicas: pure functions over the API's JSON, no client, no I/O.

Semantics followed (``discovery.k8s.io/v1``):

- An endpoint is a replica only when it is *ready* and not *terminating*. ``ready`` absent means
  ready (the API says an unknown state should be taken as ready); a terminating pod may still be
  ``serving`` its in-flight requests, but new work must not go there, so it leaves at once.
- The first address of an endpoint is used (addresses are fungible, kube-proxy does the same).
- A dual-stack service has one set of slices per family: only slices of the configured
  ``addressType`` count, so a pod is not a member twice. FQDN slices are ignored.
- The port is a fixed number, the slice port with the configured name, or the slice's only port.
- An endpoint may briefly appear in two slices while the controller moves it: replicas are
  deduplicated by name (the pod name), the slice that sorts first winning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.fleet.discovery.settings import AddressType
from extproc.fleet.discovery.source import canonical, host_port
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True, slots=True)
class PortChoice:
    """Which port of a slice the replicas listen on, and which slices count."""

    port: int | None = None
    port_name: str | None = None
    address_type: AddressType = "IPv4"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def slice_name(obj: Mapping[str, Any]) -> str:
    """``metadata.name`` of a slice ('' when missing)."""
    return str(_mapping(obj.get("metadata")).get("name") or "")


def resource_version(obj: Mapping[str, Any]) -> str | None:
    """``metadata.resourceVersion`` of an object or a list, if any."""
    rv = _mapping(obj.get("metadata")).get("resourceVersion")
    return str(rv) if rv else None


def _slice_port(obj: Mapping[str, Any], choice: PortChoice) -> int | None:
    if choice.port is not None:
        return choice.port
    ports = [p for p in obj.get("ports") or () if isinstance(p, Mapping) and isinstance(p.get("port"), int)]
    if choice.port_name is not None:
        named = [p["port"] for p in ports if p.get("name") == choice.port_name]
        return named[0] if named else None
    if len(ports) == 1:
        return int(ports[0]["port"])
    return None


def is_ready(endpoint: Mapping[str, Any]) -> bool:
    """Ready (or of unknown readiness) and not terminating."""
    conditions = _mapping(endpoint.get("conditions"))
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def replicas_of_slice(obj: Mapping[str, Any], choice: PortChoice) -> tuple[Replica, ...]:
    """The ready endpoints of one slice as replicas (none if the slice is of another address type
    or has no usable port). A replica is named after its pod, else its hostname, else its address;
    its zone and node become labels."""
    if obj.get("addressType") != choice.address_type:
        return ()
    port = _slice_port(obj, choice)
    if port is None:
        log.debug("slice %s: no port %s", slice_name(obj), choice.port_name or "(several, none chosen)")
        return ()
    replicas = []
    for endpoint in obj.get("endpoints") or ():
        if not isinstance(endpoint, Mapping) or not is_ready(endpoint):
            continue
        addresses = [a for a in endpoint.get("addresses") or () if isinstance(a, str) and a]
        if not addresses:
            continue
        try:
            address = host_port(addresses[0], port)
        except ValueError:  # not an IP: the API server validates this, a fake or a proxy might not
            continue
        ref = _mapping(endpoint.get("targetRef"))
        name = (ref.get("name") if ref.get("kind") == "Pod" else None) or endpoint.get("hostname") or address
        labels = {}
        if endpoint.get("zone"):
            labels["zone"] = str(endpoint["zone"])
        if endpoint.get("nodeName"):
            labels["node"] = str(endpoint["nodeName"])
        replicas.append(Replica(str(name), address, 1.0, labels))
    return tuple(replicas)


class SliceSet:
    """The slices of one service as last seen, and the replicas they make."""

    def __init__(self, choice: PortChoice) -> None:
        self.choice = choice
        self._slices: dict[str, tuple[Replica, ...]] = {}

    def __len__(self) -> int:
        return len(self._slices)

    def reset(self, items: Iterable[Mapping[str, Any]]) -> None:
        """Replace everything with a fresh list (after a list call)."""
        self._slices = {}
        for obj in items:
            self.put(obj)

    def put(self, obj: Mapping[str, Any]) -> None:
        """A slice was added or modified."""
        self._slices[slice_name(obj)] = replicas_of_slice(obj, self.choice)

    def remove(self, obj: Mapping[str, Any]) -> None:
        """A slice was deleted."""
        self._slices.pop(slice_name(obj), None)

    def replicas(self) -> tuple[Replica, ...]:
        """Every ready endpoint of every slice, deduplicated by name, sorted by name."""
        return canonical(r for name in sorted(self._slices) for r in self._slices[name])
