"""Typed field values every builder uses: durations, addresses, endpoints, typed extension configs."""

from __future__ import annotations

import datetime

import betterproto2
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    Pipe,
    SocketAddress,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import Endpoint, LbEndpoint
from envoy_data_plane.google.protobuf import Any as AnyMessage


def duration(value: float) -> datetime.timedelta:
    """A duration of ``value`` seconds."""
    return datetime.timedelta(seconds=value)


def typed_extension(name: str, message: betterproto2.Message) -> TypedExtensionConfig:
    """``message`` packed as the typed config of the extension ``name``."""
    # ``Any.pack`` looks the type URL up in envoy-data-plane's message pool, so only a message
    # class the package knows can be packed; the type URL is never typed by hand.
    return TypedExtensionConfig(name=name, typed_config=AnyMessage.pack(message))


def envoy_address(address: str) -> Address:
    """A ``HOST:PORT`` or ``unix:PATH`` address as Envoy's ``Address``."""
    if address.startswith("unix:"):
        return Address(pipe=Pipe(path=address[len("unix:") :]))
    host, _, port = address.rpartition(":")
    return Address(socket_address=SocketAddress(address=host, port_value=int(port)))


def lb_endpoint(address: str) -> LbEndpoint:
    """One load-balancing endpoint at ``address``."""
    return LbEndpoint(endpoint=Endpoint(address=envoy_address(address)))
