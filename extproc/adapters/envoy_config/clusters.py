"""Clusters: the replicas' (outlier detection, health checks, endpoint mode's override-host
policy), the processor's (TLS when asked) and the tracing collector's."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    ClusterLbPolicy,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.core.v3 import (
    DataSource,
    HealthCheck,
    HealthCheckHttpHealthCheck,
    Http2ProtocolOptions,
    TransportSocket,
)
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment, LocalityLbEndpoints
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
    OverrideHost,
    OverrideHostOverrideHostSource,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
    CertificateValidationContext,
    CommonTlsContext,
    SubjectAltNameMatcher,
    SubjectAltNameMatcherSanType,
    TlsCertificate,
    UpstreamTlsContext,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.envoy.type.metadata.v3 import MetadataKey, MetadataKeyPathSegment
from envoy_data_plane.google.protobuf import Any as AnyMessage

from extproc.adapters.envoy_config.spec import (
    BUFFER_LIMIT,
    HTTP_OPTIONS,
    MAX_RETRIES,
    TRACING_CLUSTER,
    GatewaySpec,
    ProcessorTls,
)
from extproc.adapters.envoy_config.values import duration, lb_endpoint, typed_extension


def outlier_detection() -> OutlierDetection:
    """The replica clusters' passive ejection."""
    # The processor decides the rotation; Envoy's passive ejection only spares a dead replica the
    # attempts made before the processor has noticed (about a second). So a short ejection (1 s,
    # growing while the host keeps failing): a longer one outlasts the processor's readmission,
    # and the replica's own cluster keeps sending its conversations to priority 1 meanwhile.
    return OutlierDetection(
        consecutive_gateway_failure=3,
        interval=duration(1),
        base_ejection_time=duration(1),
        max_ejection_percent=50,
    )


def health_checks(spec: GatewaySpec) -> list[HealthCheck]:
    """The replica clusters' active health checks (none without ``spec.health_check_path``)."""
    if spec.health_check_path is None:
        return []
    # Each replica cluster checks every replica (itself at priority 0, the others at 1): N x N
    # checks per interval. no_traffic_interval keeps the clusters of idle replicas quiet.
    return [
        HealthCheck(
            timeout=duration(0.5),
            interval=duration(1),
            no_traffic_interval=duration(5),
            unhealthy_threshold=1,
            healthy_threshold=2,
            http_health_check=HealthCheckHttpHealthCheck(path=spec.health_check_path),
        )
    ]


def static_cluster(name: str, localities: list[LocalityLbEndpoints], dns: bool = False, **extra: Any) -> Cluster:
    """A replica cluster over ``localities`` (resolved by DNS when ``dns``), with ``extra`` fields."""
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS if dns else ClusterDiscoveryType.STATIC,
        connect_timeout=duration(1),
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        load_assignment=ClusterLoadAssignment(cluster_name=name, endpoints=localities),
        # Kubernetes DNS answers for a Service change as pods come and go; look again often.
        dns_refresh_rate=duration(2) if dns else None,
        # Envoy allows 3 concurrent retries per cluster by default: when a replica dies, every
        # request in flight to it fails at once and those past the third got a 503 (retry
        # overflow; benchmarks/fault_matrix.md). Retries here are only for connect failures and
        # resets, at most 2 per request, so the bound is raised to the default max_requests.
        circuit_breakers=CircuitBreakers(thresholds=[CircuitBreakersThresholds(max_retries=MAX_RETRIES)]),
        **extra,
    )


def override_host_policy(spec: GatewaySpec) -> LoadBalancingPolicy:
    """Endpoint mode's load balancing: the processor's pick (metadata list, then header), else round robin."""
    # The metadata first: it carries the fallbacks after the chosen pod; the header has only the pod.
    override = OverrideHost(
        override_host_sources=[
            OverrideHostOverrideHostSource(
                metadata=MetadataKey(key="envoy.lb", path=[MetadataKeyPathSegment(key=spec.endpoint_header)])
            ),
            OverrideHostOverrideHostSource(header=spec.endpoint_header),
        ],
        fallback_policy=LoadBalancingPolicy(
            policies=[
                LoadBalancingPolicyPolicy(
                    typed_extension_config=typed_extension("envoy.load_balancing_policies.round_robin", RoundRobin())
                )
            ]
        ),
    )
    return LoadBalancingPolicy(
        policies=[
            LoadBalancingPolicyPolicy(
                typed_extension_config=typed_extension("envoy.load_balancing_policies.override_host", override)
            )
        ]
    )


def processor_transport_socket(tls: ProcessorTls) -> TransportSocket:
    """An ``UpstreamTlsContext`` for the processor cluster: ALPN h2 (gRPC), the processor's
    certificate verified against the CA (and its SAN, when a server name is given), and a client
    certificate for mTLS."""
    sans = []
    if tls.server_name:
        sans = [
            SubjectAltNameMatcher(
                san_type=SubjectAltNameMatcherSanType.DNS, matcher=StringMatcher(exact=tls.server_name)
            )
        ]
    certificates = []
    if tls.cert_file and tls.key_file:
        certificates = [
            TlsCertificate(
                certificate_chain=DataSource(filename=tls.cert_file), private_key=DataSource(filename=tls.key_file)
            )
        ]
    context = UpstreamTlsContext(
        common_tls_context=CommonTlsContext(
            tls_certificates=certificates,
            validation_context=CertificateValidationContext(
                trusted_ca=DataSource(filename=tls.ca_file), match_typed_subject_alt_names=sans
            ),
            alpn_protocols=["h2"],
        ),
        sni=tls.server_name or "",
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=AnyMessage.pack(context))


def processor_cluster(
    name: str, addresses: Sequence[str], tls: ProcessorTls | None = None, streams_per_connection: int | None = None
) -> Cluster:
    """The cluster of the processor(s): HTTP/2 (gRPC), TCP or unix sockets, TLS when ``tls``;
    at most ``streams_per_connection`` ext_proc streams on one connection when given."""
    http2 = Http2ProtocolOptions(max_concurrent_streams=streams_per_connection)
    options = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http2_protocol_options=http2)
    )
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=duration(1),
        lb_policy=ClusterLbPolicy.ROUND_ROBIN,
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[lb_endpoint(a) for a in addresses])]
        ),
        typed_extension_protocol_options={HTTP_OPTIONS: AnyMessage.pack(options)},
        transport_socket=processor_transport_socket(tls) if tls is not None else None,
    )


def collector_cluster(address: str) -> Cluster:
    """The OTLP/gRPC collector's cluster: HTTP/2, plaintext (a sidecar or node agent); a host
    name is resolved by DNS (a Service), an IP address taken as it is."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
        dns = False
    except ValueError:
        dns = True
    options = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http2_protocol_options=Http2ProtocolOptions())
    )
    return Cluster(
        name=TRACING_CLUSTER,
        type=ClusterDiscoveryType.STRICT_DNS if dns else ClusterDiscoveryType.STATIC,
        connect_timeout=duration(1),
        load_assignment=ClusterLoadAssignment(
            cluster_name=TRACING_CLUSTER, endpoints=[LocalityLbEndpoints(lb_endpoints=[lb_endpoint(address)])]
        ),
        typed_extension_protocol_options={HTTP_OPTIONS: AnyMessage.pack(options)},
    )
