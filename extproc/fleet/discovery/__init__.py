"""Discovery: where the fleet's members come from (the config, DNS, Kubernetes EndpointSlices, or
an InferencePool and its pods).

A :class:`Discovery` source yields complete replica lists; a :class:`DiscoveryLoop` debounces them
and hands the changes to ``Router.set_replicas`` as joins and leaves. The Kubernetes client and
dnspython are imported only by the source that needs them.
"""

from extproc.fleet.discovery.dns import DnsDiscovery, DnsPythonResolver, ResolutionError, Resolver, SrvRecord
from extproc.fleet.discovery.endpoint_slices import PortChoice, SliceSet, replicas_of_slice
from extproc.fleet.discovery.factory import build_discovery, run_discovery
from extproc.fleet.discovery.inference_pool import PodSet, PoolSpec, pool_spec, replicas_of_pod
from extproc.fleet.discovery.kubernetes_watch import KubernetesDiscovery
from extproc.fleet.discovery.loop import DiscoveryLoop, MembershipTarget
from extproc.fleet.discovery.observer import DiscoveryObserver, NullDiscoveryObserver
from extproc.fleet.discovery.pool_watch import InferencePoolDiscovery
from extproc.fleet.discovery.settings import (
    SOURCE_KINDS,
    DiscoverySettings,
    DnsSource,
    InferencePoolSource,
    KubernetesSource,
    StaticSource,
)
from extproc.fleet.discovery.source import Discovery, StaticDiscovery, canonical

__all__ = [
    "SOURCE_KINDS",
    "Discovery",
    "DiscoveryLoop",
    "DiscoveryObserver",
    "DiscoverySettings",
    "DnsDiscovery",
    "DnsPythonResolver",
    "DnsSource",
    "InferencePoolDiscovery",
    "InferencePoolSource",
    "KubernetesDiscovery",
    "KubernetesSource",
    "MembershipTarget",
    "NullDiscoveryObserver",
    "PodSet",
    "PoolSpec",
    "PortChoice",
    "ResolutionError",
    "Resolver",
    "SliceSet",
    "SrvRecord",
    "StaticDiscovery",
    "StaticSource",
    "build_discovery",
    "canonical",
    "pool_spec",
    "replicas_of_pod",
    "replicas_of_slice",
    "run_discovery",
]
