"""The Istio ``EnvoyFilter`` that inserts the same filters into an Istio ingress gateway."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy_data_plane.envoy.config.cluster.v3 import Cluster
from envoy_data_plane.envoy.config.listener.v3 import Listener

from extproc.adapters.envoy_config.clusters import override_host_policy
from extproc.adapters.envoy_config.filters import ext_proc_filter, header_mutation_filter
from extproc.adapters.envoy_config.rendering import to_dict
from extproc.adapters.envoy_config.spec import BUFFER_LIMIT, HCM_FILTER, ROUTER_FILTER, GatewaySpec
from extproc.request.tenant import TENANT_HEADER


def dns_address(service: str, namespace: str, port: int) -> str:
    """A Kubernetes Service's cluster DNS name and port."""
    return f"{service}.{namespace}.svc.cluster.local:{port}"


@dataclass(frozen=True, slots=True)
class IstioSpec:
    """What the Istio ``EnvoyFilter`` needs: where our processor and the model servers are."""

    processor_service: str  # HOST:PORT of our processor's Service (port appProtocol grpc)
    replicas_service: str  # HOST of the model servers' Service, as Istio names its clusters
    replicas_port: int
    namespace: str = "istio-system"
    name: str = "extproc-router"
    gateway_labels: Mapping[str, str] = field(default_factory=lambda: {"istio": "ingressgateway"})
    endpoint_header: str = "x-gateway-destination-endpoint"
    cluster_header: str = "x-target-cluster"
    identity_headers: tuple[str, ...] = (TENANT_HEADER,)
    message_timeout_ms: int = 1000
    observe_responses: bool = True

    @property
    def processor_cluster(self) -> str:
        """The cluster Istio generates for our processor's Service port."""
        host, _, port = self.processor_service.rpartition(":")
        return f"outbound|{port}||{host}"


def istio_envoy_filter(spec: IstioSpec) -> dict[str, Any]:
    """An Istio ``EnvoyFilter`` that makes an ingress gateway route through our processor.

    Built with the same typed builders as the bootstrap (the MERGE values are partial typed
    messages too). The patches: the header_mutation filter first of all (a client's copy of every
    header the router trusts gone before any other filter), the ext_proc filter before the
    router; the ``override_host`` policy merged into Istio's cluster for the model servers, so the
    pod the processor names is used and round robin is the fallback; and the 16 MiB buffer limit
    of the standalone gateway on the gateway's listeners. The processor runs in endpoint mode.

    The ext_proc filter calls the cluster Istio generates for our processor's Service
    (``outbound|9002||extproc...``) rather than a cluster added by the patch: Istio's cluster
    carries the mesh's mTLS, so the call also works where PeerAuthentication is STRICT, and is
    HTTP/2 because the Service port declares ``appProtocol: grpc``.
    """
    gateway = GatewaySpec(
        replicas=(),
        mode="endpoint",
        endpoint_header=spec.endpoint_header,
        cluster_header=spec.cluster_header,
        identity_headers=spec.identity_headers,
        message_timeout_ms=spec.message_timeout_ms,
        observe_responses=spec.observe_responses,
    )
    before_router = {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {"name": HCM_FILTER, "subFilter": {"name": ROUTER_FILTER}}}},
    }
    patches = [
        # The strip first of all (before Istio's own authentication, which may then set an
        # identity header from a JWT claim); ext_proc just before the router.
        {
            "applyTo": "HTTP_FILTER",
            "match": {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": HCM_FILTER}}}},
            "patch": {"operation": "INSERT_FIRST", "value": to_dict(header_mutation_filter(gateway))},
        },
        {
            "applyTo": "HTTP_FILTER",
            "match": before_router,
            "patch": {"operation": "INSERT_BEFORE", "value": to_dict(ext_proc_filter(gateway, spec.processor_cluster))},
        },
        {
            "applyTo": "CLUSTER",
            "match": {
                "context": "GATEWAY",
                "cluster": {"service": spec.replicas_service, "portNumber": spec.replicas_port},
            },
            "patch": {
                "operation": "MERGE",
                "value": to_dict(
                    Cluster(
                        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
                        load_balancing_policy=override_host_policy(gateway),
                    )
                ),
            },
        },
        # Istio's gateway listeners buffer far less than a long prompt: BUFFERED bodies above the
        # limit get 413, so raise it to what the standalone gateway allows.
        {
            "applyTo": "LISTENER",
            "match": {"context": "GATEWAY"},
            "patch": {"operation": "MERGE", "value": to_dict(Listener(per_connection_buffer_limit_bytes=BUFFER_LIMIT))},
        },
    ]
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {"workloadSelector": {"labels": dict(spec.gateway_labels)}, "configPatches": patches},
    }


def istio_header_strip(spec: IstioSpec) -> dict[str, Any]:
    """An Istio ``EnvoyFilter`` with the strip alone: the header_mutation filter first in a
    gateway's chain, for a gateway whose ext_proc filter is not ours (a Gateway API Inference
    Extension gateway calling our processor as its endpoint picker). With it a client's copy of
    every header the router trusts is gone before any filter, so a pool that fails open, the
    processor down, cannot be steered by one (``x-prefiller-host-port`` to a decode replica's
    sidecar)."""
    gateway = GatewaySpec(
        replicas=(),
        mode="endpoint",
        endpoint_header=spec.endpoint_header,
        cluster_header=spec.cluster_header,
        identity_headers=spec.identity_headers,
    )
    patch = {
        "applyTo": "HTTP_FILTER",
        "match": {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": HCM_FILTER}}}},
        "patch": {"operation": "INSERT_FIRST", "value": to_dict(header_mutation_filter(gateway))},
    }
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {"workloadSelector": {"labels": dict(spec.gateway_labels)}, "configPatches": [patch]},
    }


# The ``extproc envoy-config`` command (its arguments are declared in extproc.adapters.cli, which imports
# this module only for that command, so ``extproc serve`` never loads envoy_data_plane).
