"""The discovery protocol: a source of replica lists, and the static source.

A source yields the *whole* current list each time it may have changed (never a diff): a
consumer that misses one list loses nothing, the next one is complete. Sources may repeat a list;
the :class:`~extproc.fleet.discovery.loop.DiscoveryLoop` only acts when the set really changes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import Protocol

from extproc.routing.model import Replica


class Discovery(Protocol):
    """Where the fleet's members come from."""

    def updates(self) -> AsyncIterator[Sequence[Replica]]:
        """Yield the complete replica list whenever it may have changed; run until cancelled
        (a source with nothing more to say may end). Transient failures are the source's to
        absorb: it keeps quiet, or repeats the last good list, rather than yield an empty one."""
        ...


class StaticDiscovery:
    """The config's replicas, once."""

    def __init__(self, replicas: Iterable[Replica]) -> None:
        self.replicas = tuple(replicas)

    async def updates(self) -> AsyncGenerator[Sequence[Replica], None]:
        """Yield the configured list, then end."""
        yield self.replicas

    def __repr__(self) -> str:
        return f"static({len(self.replicas)} replicas)"


def canonical(replicas: Iterable[Replica]) -> tuple[Replica, ...]:
    """The list sorted by name, the first of duplicate names kept: two lists with the same
    members compare equal whatever order a source produced them in."""
    seen: dict[str, Replica] = {}
    for r in replicas:
        seen.setdefault(r.name, r)
    return tuple(seen[name] for name in sorted(seen))


def host_port(ip: str, port: int) -> str:
    """``ip:port``, with brackets around an IPv6 address; ValueError if ``ip`` is not an IP."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"
