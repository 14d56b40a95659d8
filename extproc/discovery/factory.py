"""Builds the configured discovery source and runs its loop (what ``extproc serve`` starts)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extproc.discovery.dns import DnsDiscovery
from extproc.discovery.kubernetes_watch import KubernetesDiscovery
from extproc.discovery.loop import DiscoveryLoop, MembershipTarget
from extproc.discovery.settings import DiscoverySettings, DnsSource, KubernetesSource
from extproc.discovery.source import Discovery, StaticDiscovery
from extproc.metrics import RouterMetrics
from extproc.routing.model import Replica

if TYPE_CHECKING:
    from extproc.config import Config

log = logging.getLogger("extproc.discovery")


def build_discovery(settings: DiscoverySettings, replicas: Sequence[Replica] = ()) -> Discovery:
    """The source ``settings`` describe (``replicas`` are the static source's list)."""
    source = settings.source
    if isinstance(source, DnsSource):
        return DnsDiscovery(source.name, source.port, source.record, source.interval_s, timeout_s=source.timeout_s)
    if isinstance(source, KubernetesSource):
        return KubernetesDiscovery(
            source.service,
            namespace=source.namespace,
            port=source.port,
            port_name=source.port_name,
            address_type=source.address_type,
            kubeconfig=source.kubeconfig,
            context=source.context,
            watch_timeout_s=source.watch_timeout_s,
        )
    return StaticDiscovery(replicas)


async def run_discovery(config: Config, target: MembershipTarget, metrics: RouterMetrics | None = None) -> None:
    """Keep ``target``'s membership in line with ``config.discovery`` until cancelled. With the
    static source there is nothing to follow: the router starts with the config's replicas."""
    settings = config.discovery
    if settings.is_static:
        return
    if config.mode == "cluster":
        # Discovered replicas are named after pods (or addresses): in cluster mode these names
        # are the Envoy clusters the router answers with, so Envoy must define them.
        log.warning("discovery in cluster mode: Envoy needs a cluster named after each discovered replica")
    source = build_discovery(settings, config.replicas)
    loop = DiscoveryLoop(
        source,
        target,
        settings.debounce_s,
        settings.max_delay_s,
        static=config.replicas,
        metrics=metrics,
    )
    await loop.run()
