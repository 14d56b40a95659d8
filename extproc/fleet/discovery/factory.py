"""Builds the configured discovery source and runs its loop (what ``extproc serve`` starts)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.dns import DnsDiscovery
from extproc.fleet.discovery.kubernetes_watch import KubernetesDiscovery
from extproc.fleet.discovery.loop import DiscoveryLoop, MembershipTarget
from extproc.fleet.discovery.observer import DiscoveryObserver
from extproc.fleet.discovery.pool_watch import InferencePoolDiscovery
from extproc.fleet.discovery.settings import DiscoverySettings, DnsSource, InferencePoolSource, KubernetesSource
from extproc.fleet.discovery.source import Discovery, StaticDiscovery
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")


def build_discovery(
    settings: DiscoverySettings, replicas: Sequence[Replica] = (), world: World = REAL_WORLD
) -> Discovery:
    """The source ``settings`` describe (``replicas`` are the static source's list), waiting on
    ``world``'s time."""
    source = settings
    if isinstance(source, DnsSource):
        return DnsDiscovery(
            source.name, source.port, source.record, source.interval_s, timeout_s=source.timeout_s, world=world
        )
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
            world=world,
        )
    if isinstance(source, InferencePoolSource):
        return InferencePoolDiscovery(
            source.name,
            namespace=source.namespace,
            kubeconfig=source.kubeconfig,
            context=source.context,
            watch_timeout_s=source.watch_timeout_s,
            world=world,
        )
    return StaticDiscovery(replicas)


async def run_discovery(
    settings: DiscoverySettings,
    target: MembershipTarget,
    metrics: DiscoveryObserver | None = None,
    *,
    static: Sequence[Replica] = (),
    cluster_mode: bool = False,
    world: World = REAL_WORLD,
) -> None:
    """Keep ``target``'s membership in line with ``settings`` until cancelled; ``static`` replicas
    stay members. With the static source there is nothing to follow: the router starts with them."""
    if settings.is_static:
        return
    if cluster_mode:
        # Discovered replicas are named after pods (or addresses): in cluster mode these names
        # are the Envoy clusters the router answers with, so Envoy must define them.
        log.warning("discovery in cluster mode: Envoy needs a cluster named after each discovered replica")
    source = build_discovery(settings, static, world)
    loop = DiscoveryLoop(
        source,
        target,
        settings.debounce_s,
        settings.max_delay_s,
        static=static,
        metrics=metrics,
        world=world,
    )
    await loop.run()
