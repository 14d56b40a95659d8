"""The gateway's subset hint: the endpoints a request may go to.

A gateway that implements InferencePool may tell the endpoint picker which of the pool's endpoints
it offers for this request: filter metadata ``envoy.lb.subset_hint``, key
``x-gateway-destination-endpoint-subset``, a list of ``ip:port`` strings (GIE's endpoint-picker
protocol). The picker must pick among them; when the list is empty, or none of them is a known
replica, it answers 503.

The ext_proc adapter reads the metadata and hands the list on among the request's headers under
:data:`SUBSET_KEY`, a pseudo-header name no client can send (HTTP/2 refuses unknown pseudo-headers,
HTTP/1 has none), which the adapter also removes from what Envoy sent before setting it. So the
subset reaches the features as every other request input does, and nothing a client sends can
narrow or widen it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_FIELD = "x-gateway-destination-endpoint-subset"
SUBSET_KEY = ":x-gateway-destination-endpoint-subset"
"""Where the adapter puts the hint among the request's headers (comma-separated)."""


def encode_subset(endpoints: Iterable[str]) -> str:
    """The hint as the value of :data:`SUBSET_KEY`."""
    return ",".join(e.strip() for e in endpoints if e.strip())


def decode_subset(value: str | None) -> frozenset[str] | None:
    """The endpoints of a :data:`SUBSET_KEY` value (None: no hint; empty: a hint that offers none)."""
    if value is None:
        return None
    return frozenset(_canonical(e) for e in value.split(",") if e.strip())


def _canonical(endpoint: str) -> str:
    """``ip:port`` as a replica's address is written (brackets around IPv6), or a bare IP."""
    endpoint = endpoint.strip()
    try:
        return str(ipaddress.ip_address(endpoint.strip("[]")))  # a bare IP: any of its ports
    except ValueError:
        pass
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return endpoint
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def in_subset(address: str, subset: frozenset[str]) -> bool:
    """Whether a replica at ``address`` (``ip:port``) is among the endpoints offered: its address,
    or its IP alone (a hint of bare IPs offers every port of the pod)."""
    if address in subset:
        return True
    host = address.rpartition(":")[0].strip("[]")
    return host in subset
