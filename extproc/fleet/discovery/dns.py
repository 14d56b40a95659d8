"""DNS discovery: a headless service re-resolved on an interval.

A headless Kubernetes service (``clusterIP: None``) answers its name with one A/AAAA record per
ready pod, and ``_port._proto.name`` with one SRV record per ready pod and port. Records are
resolved through an injected :class:`Resolver` (dnspython's asyncio resolver by default; tests
pass a fake), so nothing here blocks the event loop.

A failed resolution -- timeout, SERVFAIL, NXDOMAIN, an empty answer, one SRV target that does not
resolve -- keeps the last good list. An empty fleet cannot route anything, while a stale member
costs little: the health scraper finds it unreachable within a scrape interval and takes it out
of the rotation. So DNS never empties the fleet; scaling to zero is not something it can tell
apart from a broken resolver (Kubernetes discovery can).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.settings import DnsRecord
from extproc.fleet.discovery.source import host_port
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")

AddressRecord = Literal["A", "AAAA"]


class ResolutionError(Exception):
    """A name did not resolve (any reason: timeout, NXDOMAIN, no answer, no nameserver)."""


@dataclass(frozen=True, slots=True)
class SrvRecord:
    """One SRV answer. Priority and weight are kept for completeness; every record is a replica
    (Kubernetes gives them all the same priority, and the router weighs replicas by itself)."""

    target: str
    port: int
    priority: int = 0
    weight: int = 0


class Resolver(Protocol):
    """Asks DNS; raises :class:`ResolutionError` when there is no usable answer."""

    async def addresses(self, host: str, record: AddressRecord) -> list[str]:
        """The addresses of ``host`` (A: IPv4, AAAA: IPv6), as text."""
        ...

    async def services(self, name: str) -> list[SrvRecord]:
        """The SRV records of ``name``."""
        ...


class DnsPythonResolver:
    """The default :class:`Resolver`: dnspython's asyncio stub resolver (``/etc/resolv.conf``,
    its search domains included, so a short in-cluster name works as it does for the pod), or
    the given ``nameservers`` on ``port``."""

    def __init__(self, timeout_s: float = 2.0, nameservers: Sequence[str] | None = None, port: int = 53) -> None:
        self.timeout_s = timeout_s
        self.nameservers = list(nameservers) if nameservers else None
        self.port = port
        self._resolver: Any = None

    async def addresses(self, host: str, record: AddressRecord) -> list[str]:
        """A or AAAA records of ``host``."""
        answer = await self._resolve(host, record)
        return [rdata.to_text() for rdata in answer]

    async def services(self, name: str) -> list[SrvRecord]:
        """SRV records of ``name``."""
        answer = await self._resolve(name, "SRV")
        return [
            SrvRecord(rdata.target.to_text(omit_final_dot=True), rdata.port, rdata.priority, rdata.weight)
            for rdata in answer
        ]

    async def _resolve(self, name: str, rdtype: str) -> list[Any]:
        import dns.asyncresolver  # imported here: only a DNS source needs dnspython
        import dns.exception

        try:
            if self._resolver is None:
                # Built at first use, inside the try: a missing /etc/resolv.conf is then one more
                # failed resolution, logged and retried, not a discovery task dead at start-up.
                resolver = dns.asyncresolver.Resolver(configure=self.nameservers is None)
                if self.nameservers is not None:
                    resolver.nameservers = self.nameservers
                    resolver.port = self.port
                self._resolver = resolver
            answer = await self._resolver.resolve(name, rdtype, lifetime=self.timeout_s, search=True)
        except dns.exception.DNSException as exc:
            raise ResolutionError(f"{name} {rdtype}: {type(exc).__name__}: {exc}") from None
        return list(answer)


class DnsDiscovery:
    """Resolves ``name`` every ``interval_s`` and yields the replicas it found.

    Names: with A/AAAA records a replica is named after its ``ip:port`` (all a pod's identity
    DNS gives); with SRV records, after the record's target host (a pod's stable hostname in a
    StatefulSet), its address being the target's resolved ``ip:port``.
    """

    def __init__(
        self,
        name: str,
        port: int | None = None,
        record: DnsRecord = "A",
        interval_s: float = 10.0,
        resolver: Resolver | None = None,
        timeout_s: float = 2.0,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        if record != "SRV" and port is None:
            raise ValueError(f"a port is required with {record} records")
        self.name = name
        self.port = port
        self.record = record
        self.interval_s = interval_s
        self.world = world  # the interval is slept on its time
        self.resolver: Resolver = resolver or DnsPythonResolver(timeout_s)

    def __repr__(self) -> str:
        return f"dns({self.record} {self.name})"

    async def resolve(self) -> tuple[Replica, ...]:
        """One resolution; raises :class:`ResolutionError` (an empty answer is one too)."""
        if self.record == "SRV":
            replicas = await self._resolve_srv()
        else:
            assert self.port is not None
            ips = await self.resolver.addresses(self.name, self.record)
            addresses = sorted({host_port(ip, self.port) for ip in ips})
            replicas = tuple(Replica(a, a) for a in addresses)
        if not replicas:
            raise ResolutionError(f"{self.name} {self.record}: no records")
        return replicas

    async def _resolve_srv(self) -> tuple[Replica, ...]:
        records = sorted(set(await self.resolver.services(self.name)), key=lambda r: (r.target, r.port))
        # All targets or nothing: dropping the one that failed to resolve would be a leave
        # caused by a transient error.
        resolved = await asyncio.gather(*(self._target_addresses(r.target) for r in records))
        pairs = [(r.target, host_port(ip, r.port)) for r, ips in zip(records, resolved, strict=True) for ip in ips]
        per_target: dict[str, int] = {}
        for target, _ in pairs:
            per_target[target] = per_target.get(target, 0) + 1
        # A target with one address (the usual case) is named after the target itself; one with
        # several (two ports, or several addresses) gets one replica per address.
        return tuple(
            Replica(target if per_target[target] == 1 else f"{target}/{address}", address)
            for target, address in sorted(set(pairs))
        )

    async def _target_addresses(self, target: str) -> list[str]:
        try:
            return await self.resolver.addresses(target, "A")
        except ResolutionError:
            return await self.resolver.addresses(target, "AAAA")

    async def updates(self) -> AsyncGenerator[Sequence[Replica], None]:
        """Resolve now, then every ``interval_s``; after a failure, repeat the last good list."""
        last: tuple[Replica, ...] | None = None
        failing = False
        while True:
            try:
                last = await self.resolve()
                if failing:
                    log.info("discovery %r: resolving again (%d replicas)", self, len(last))
                failing = False
            except ResolutionError as exc:
                # Warn once per outage, not every interval.
                level = logging.DEBUG if failing else logging.WARNING
                kept = f"keeping the last {len(last)} replicas" if last is not None else "no replicas yet"
                log.log(level, "discovery %r failed (%s): %s", self, kept, exc)
                failing = True
            if last is not None:
                yield last
            await self.world.sleep(self.interval_s)
