"""Envoy bootstrap configs for the gateway, rendered from the router's replica list.

Every message is built from envoy-data-plane's typed classes (betterproto2 messages that are
pydantic dataclasses), so a misspelt field, a value of the wrong type or an ``Any`` of an unknown
type fails here, at render time, instead of in ``envoy --mode validate`` or, worse, at start-up on
a production gateway. This module is imported by ``extproc envoy-config``, the local gateway and
the tests; the processor's request path never imports it (betterproto2 parsing is about 65 times
slower than the upb messages the servicer uses).

Two modes, one shape: a route taken when our routing header is present, and a default route
(plain round robin over every replica) taken when it is not, so a dead or slow processor
(``failure_mode_allow``) degrades to load balancing instead of 500s. Client-sent routing
headers are stripped before ext_proc runs, so a client never picks its own replica, even when
the processor is down.

- ``cluster``: one Envoy cluster per replica, chosen with ``route.cluster_header``. Each
  replica's cluster also lists every other replica at priority 1: a connect failure or reset
  is retried on another replica (``previous_priorities``), so a dead replica costs no client
  error for requests that had not reached it.
- ``endpoint``: the Gateway API Inference Extension's endpoint-picker protocol: the processor
  names the pod's ``ip:port`` in ``x-gateway-destination-endpoint`` and, with fallbacks, in the
  ``envoy.lb`` metadata. Two cluster kinds read it:
  ``override_host`` (default): a cluster of the known replicas with the ``override_host`` load
  balancing policy, which takes the metadata list, then the header, then round robin; retries
  of connect failures and resets go to another host, so a dead pod costs no client error.
  ``original_dst``: an ``ORIGINAL_DST`` cluster connects to whatever address the header names,
  for fleets Envoy does not know; a retry goes to the same address, so a dead pod's requests
  fail over only after the processor ejects it.

In both modes a routed try has a first-byte timeout (``per_try_timeout``; a hung replica's
requests are retried elsewhere in seconds, not at the route timeout), streams marked by the
processor take a route with an idle timeout, and responses carry ``x-envoy-attempt-count`` so the
processor learns which chosen replicas failed their try (:mod:`extproc.upstream_timeouts`).

The typed classes express everything used here. ``Any`` fields (``typed_config``, the
``typed_extension_protocol_options`` map) are filled with ``Any.pack(message)``, whose type URL
comes from envoy-data-plane's message pool, so no ``@type`` string is written by hand; the YAML
form comes back from ``to_dict``, which unpacks each ``Any``. The one thing that is not an Envoy
message is the Istio ``EnvoyFilter`` (a Kubernetes resource): its envelope is a plain mapping,
but every patch value in it (filters, the cluster and listener fields merged) is a typed message.

The scenarios shipped under ``envoy/`` and ``k8s/`` are named presets of :class:`GatewaySpec`
(:data:`SCENARIOS`); :func:`istio_envoy_filter` builds the Istio ``EnvoyFilter`` that inserts the
same filters into an Istio ingress gateway, from the same builders.
"""

from __future__ import annotations

import argparse
import datetime
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import betterproto2
import yaml
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    ClusterLbPolicy,
    ClusterOriginalDstLbConfig,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as HeaderMutationRule
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    DataSource,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HealthCheck,
    HealthCheckHttpHealthCheck,
    Http2ProtocolOptions,
    Pipe,
    SocketAddress,
    TransportSocket,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.route.v3 import (
    HeaderMatcher,
    RetryPolicy,
    RetryPolicyRetryHostPredicate,
    RetryPolicyRetryPriority,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import HeaderMutation, Mutations
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
    OverrideHost,
    OverrideHostOverrideHostSource,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.extensions.retry.priority.previous_priorities.v3 import PreviousPrioritiesConfig
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

from extproc.config import Config, ConfigError, load_config, parse_replica, with_overrides
from extproc.discovery.settings import DnsSource, KubernetesSource
from extproc.routing.model import Replica
from extproc.upstream_timeouts import PER_TRY_TIMEOUT_HEADER, UpstreamTimeouts

HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
ROUND_ROBIN_CLUSTER = "replicas_round_robin"
ORIGINAL_DST_CLUSTER = "replicas_original_dst"
OVERRIDE_HOST_CLUSTER = "replicas_endpoint"
PROCESSOR_CLUSTER = "extproc"
ADMIN_CLUSTER = "envoy_admin"
BUFFER_LIMIT = 16 * 1024 * 1024
MAX_RETRIES = 1024  # concurrent retries per replica cluster (Envoy's default: 3)
HEADER_MUTATION_FILTER = "envoy.filters.http.header_mutation"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
# What the probe listener passes to the admin interface: readiness and metrics, nothing that
# changes state (the admin's /quitquitquit, /drain_listeners ... stay on loopback).
ADMIN_PATHS = ("/ready", "/stats/prometheus")


@dataclass(frozen=True, slots=True)
class ProcessorTls:
    """Envoy's side of TLS to the processor: trust ``ca_file`` for the processor's certificate,
    check ``server_name`` in its SANs (and send it as SNI), and present ``cert_file``/``key_file``
    when the processor requires client certificates (``grpc.tls.client_ca_file``). Files only."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """What a gateway config needs to know."""

    replicas: Sequence[Replica]
    processor: str = "127.0.0.1:9002"
    mode: str = "cluster"
    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    cluster_header: str = "x-target-cluster"
    endpoint_header: str = "x-gateway-destination-endpoint"
    endpoint_cluster: str = "override_host"
    round_robin_listen: str | None = None
    message_timeout_ms: int = 1000
    route_timeout_s: int = 300
    retries: int = 2
    # Per try (config ``upstream:``): a try without response headers after first_byte_timeout_s is
    # retried on another replica; a stream silent for stream_idle_timeout_s is ended. The
    # processor marks streams with stream_header and gives non-streaming requests their own bound.
    first_byte_timeout_s: float = UpstreamTimeouts().first_byte_s
    stream_idle_timeout_s: float = UpstreamTimeouts().stream_idle_s
    stream_header: str = UpstreamTimeouts().stream_header
    observe_responses: bool = True
    full_duplex: bool = False
    # More processors sharing one affinity store (active-active): Envoy round-robins streams.
    extra_processors: tuple[str, ...] = ()
    # Active HTTP health checks on every replica cluster (the failover scenario): Envoy takes a
    # dead replica out of its own priority 0 within a second, before the processor has noticed.
    health_check_path: str | None = None
    # HOST:PORT of a Kubernetes Service: the replicas Envoy knows come from DNS (STRICT_DNS) while
    # the processor discovers the same pods from EndpointSlices. Endpoint mode only.
    replicas_dns: str | None = None
    # A listener that exposes only the admin's /ready and /stats/prometheus, so kubelet probes and
    # Prometheus reach them while the admin interface itself stays on loopback.
    probe_listen: str | None = None
    # TLS (mTLS with a client certificate) from Envoy to the processor, when it listens with grpc.tls.
    processor_tls: ProcessorTls | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named preset of :class:`GatewaySpec`: one folder under ``envoy/`` (or the k8s base)."""

    name: str
    summary: str
    mode: str = "cluster"
    endpoint_cluster: str = "override_host"
    processor: str = "127.0.0.1:9002"
    listen: str = "127.0.0.1:10000"
    admin: str = "127.0.0.1:9901"
    health_check_path: str | None = None
    probe_listen: str | None = None

    def spec(self, replicas: Sequence[Replica], **overrides: Any) -> GatewaySpec:
        """The spec of this scenario for ``replicas``; ``overrides`` that are not None win."""
        values: dict[str, Any] = {
            "replicas": replicas,
            "mode": self.mode,
            "endpoint_cluster": self.endpoint_cluster,
            "processor": self.processor,
            "listen": self.listen,
            "admin": self.admin,
            "health_check_path": self.health_check_path,
            "probe_listen": self.probe_listen,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return GatewaySpec(**values)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("cluster-mode", "standalone gateway: one cluster per replica, chosen by route.cluster_header"),
        Scenario("endpoint-mode", "GIE endpoint picker: override_host over the known replicas", mode="endpoint"),
        Scenario(
            "endpoint-original-dst",
            "GIE endpoint picker: an ORIGINAL_DST cluster for replicas Envoy does not know",
            mode="endpoint",
            endpoint_cluster="original_dst",
        ),
        Scenario(
            "failover",
            "cluster mode with active health checks: a dead replica costs no client error",
            health_check_path="/health",
        ),
        Scenario(
            "unix-socket",
            "cluster mode with the processor on a unix socket (a sidecar sharing a volume)",
            processor="unix:/run/extproc/extproc.sock",
        ),
        Scenario(
            "kubernetes",
            "the k8s gateway pod: endpoint picker over ORIGINAL_DST, replicas from the Service's DNS",
            mode="endpoint",
            endpoint_cluster="original_dst",
            listen="0.0.0.0:8080",
            probe_listen="0.0.0.0:9902",
        ),
    )
}


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _typed(name: str, message: betterproto2.Message) -> TypedExtensionConfig:
    # ``Any.pack`` looks the type URL up in envoy-data-plane's message pool, so only a message
    # class the package knows can be packed; the type URL is never typed by hand.
    return TypedExtensionConfig(name=name, typed_config=AnyMessage.pack(message))


def _address(address: str) -> Address:
    if address.startswith("unix:"):
        return Address(pipe=Pipe(path=address[len("unix:") :]))
    host, _, port = address.rpartition(":")
    return Address(socket_address=SocketAddress(address=host, port_value=int(port)))


def _endpoint(address: str) -> LbEndpoint:
    return LbEndpoint(endpoint=Endpoint(address=_address(address)))


def _retry_policy(retries: int, across_priorities: bool, per_try_timeout_s: float | None = None) -> RetryPolicy:
    # "reset" also covers a try that met its per-try (first-byte) timeout: Envoy resets it and, as
    # nothing has gone to the client yet, tries another host. Not 5xx: a replica's own 503 is an
    # answer (overloaded), and resending the request there or elsewhere is the processor's call.
    return RetryPolicy(
        retry_on="connect-failure,refused-stream,reset",
        num_retries=retries,
        per_try_timeout=_seconds(per_try_timeout_s) if per_try_timeout_s else None,
        retry_host_predicate=[
            RetryPolicyRetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=AnyMessage.pack(PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=5,
        retry_priority=(
            RetryPolicyRetryPriority(
                name="envoy.retry_priorities.previous_priorities",
                typed_config=AnyMessage.pack(PreviousPrioritiesConfig(update_frequency=1)),
            )
            if across_priorities
            else None
        ),
    )


def header_mutation_filter(spec: GatewaySpec) -> HttpFilter:
    """Strips the routing headers a client sent, before ext_proc runs."""
    removals = [
        HeaderMutationRule(remove=name)
        for name in (spec.cluster_header, spec.endpoint_header, spec.stream_header, PER_TRY_TIMEOUT_HEADER)
    ]
    return HttpFilter(
        name=HEADER_MUTATION_FILTER,
        typed_config=AnyMessage.pack(HeaderMutation(mutations=Mutations(request_mutations=removals))),
    )


def ext_proc_filter(spec: GatewaySpec, cluster: str = PROCESSOR_CLUSTER) -> HttpFilter:
    """The ext_proc filter: headers and the buffered body to the processor, failing open."""
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster)),
        failure_mode_allow=True,
        message_timeout=datetime.timedelta(milliseconds=spec.message_timeout_ms),
        # The processor may skip a request's response headers (health.response_sample_rate).
        allow_mode_override=True,
        # The processor sets x-envoy-upstream-rq-per-try-timeout-ms (a non-streaming request's
        # first-byte bound grows with its max_tokens); Envoy ignores x-envoy-* mutations otherwise.
        mutation_rules=HeaderMutationRules(allow_envoy=True),
        processing_mode=ProcessingMode(
            request_header_mode=send,
            # FULL_DUPLEX_STREAMED, as the Inference Extension's gateways use it, needs trailers sent.
            request_body_mode=(
                ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
                if spec.full_duplex
                else ProcessingModeBodySendMode.BUFFERED
            ),
            response_header_mode=send if spec.observe_responses else skip,
            response_body_mode=ProcessingModeBodySendMode.NONE,
            request_trailer_mode=send if spec.full_duplex else skip,
            response_trailer_mode=skip,
        ),
    )
    return HttpFilter(name=EXT_PROC_FILTER, typed_config=AnyMessage.pack(processor))


def _router_filter() -> HttpFilter:
    return HttpFilter(name=ROUTER_FILTER, typed_config=AnyMessage.pack(Router()))


def _routes(spec: GatewaySpec, with_processor: bool) -> list[Route]:
    timeout = _seconds(spec.route_timeout_s)
    default_route = Route(
        match=RouteMatch(prefix="/"),
        route=RouteAction(
            cluster=ROUND_ROBIN_CLUSTER,
            timeout=timeout,
            retry_policy=_retry_policy(spec.retries, across_priorities=False),
        ),
    )
    if not with_processor:
        return [default_route]
    header = spec.cluster_header if spec.mode == "cluster" else spec.endpoint_header

    def target(idle_s: float | None) -> RouteAction:
        first_byte_s = spec.first_byte_timeout_s
        idle = _seconds(idle_s) if idle_s else None
        if spec.mode == "cluster":
            policy = _retry_policy(spec.retries, True, first_byte_s)
            return RouteAction(
                cluster_header=spec.cluster_header, timeout=timeout, retry_policy=policy, idle_timeout=idle
            )
        if spec.endpoint_cluster == "original_dst":
            # No retries: a retry would go to the same address the header names. The per-try
            # bound still ends a hung pod's request in seconds rather than at the route timeout.
            policy = _retry_policy(0, False, first_byte_s)
            return RouteAction(cluster=ORIGINAL_DST_CLUSTER, timeout=timeout, retry_policy=policy, idle_timeout=idle)
        policy = _retry_policy(spec.retries, False, first_byte_s)
        return RouteAction(cluster=OVERRIDE_HOST_CLUSTER, timeout=timeout, retry_policy=policy, idle_timeout=idle)

    routed = [HeaderMatcher(name=header, present_match=True)]
    streaming = [*routed, HeaderMatcher(name=spec.stream_header, present_match=True)]
    return [
        # Streams first: only they get the idle timeout (a non-streaming answer is silent until
        # done). Envoy's route idle_timeout, not the retry policy's per_try_idle_timeout, which
        # (Envoy 1.40, tried) did not end a stream stalled after its headers.
        Route(match=RouteMatch(prefix="/", headers=streaming), route=target(spec.stream_idle_timeout_s)),
        Route(match=RouteMatch(prefix="/", headers=routed), route=target(None)),
        default_route,
    ]


def _http_connection_manager(spec: GatewaySpec, name: str, with_processor: bool) -> Filter:
    filters = [header_mutation_filter(spec)]
    if with_processor:
        filters.append(ext_proc_filter(spec))
    filters.append(_router_filter())
    hcm = HttpConnectionManager(
        stat_prefix=name,
        generate_request_id=True,
        route_config=RouteConfiguration(
            name=name,
            virtual_hosts=[
                VirtualHost(
                    name="inference",
                    domains=["*"],
                    routes=_routes(spec, with_processor),
                    # x-envoy-attempt-count on the response tells the processor that the replica
                    # it chose failed its try (a reset or a first-byte timeout) and another answered.
                    include_attempt_count_in_response=with_processor,
                )
            ],
        ),
        http_filters=filters,
    )
    return Filter(name=HCM_FILTER, typed_config=AnyMessage.pack(hcm))


def _probe_connection_manager() -> Filter:
    routes = [
        Route(match=RouteMatch(path=path), route=RouteAction(cluster=ADMIN_CLUSTER, timeout=_seconds(5)))
        for path in ADMIN_PATHS
    ]
    hcm = HttpConnectionManager(
        stat_prefix="probe",
        route_config=RouteConfiguration(
            name="probe", virtual_hosts=[VirtualHost(name="admin", domains=["*"], routes=routes)]
        ),
        http_filters=[_router_filter()],
    )
    return Filter(name=HCM_FILTER, typed_config=AnyMessage.pack(hcm))


def _listener(name: str, address: str, network_filter: Filter) -> Listener:
    return Listener(
        name=name,
        address=_address(address),
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        filter_chains=[FilterChain(filters=[network_filter])],
    )


def _outlier_detection() -> OutlierDetection:
    # The processor decides the rotation; Envoy's passive ejection only spares a dead replica the
    # attempts made before the processor has noticed (about a second). So a short ejection (1 s,
    # growing while the host keeps failing): a longer one outlasts the processor's readmission,
    # and the replica's own cluster keeps sending its conversations to priority 1 meanwhile.
    return OutlierDetection(
        consecutive_gateway_failure=3,
        interval=_seconds(1),
        base_ejection_time=_seconds(1),
        max_ejection_percent=50,
    )


def _health_checks(spec: GatewaySpec) -> list[HealthCheck]:
    if spec.health_check_path is None:
        return []
    # Each replica cluster checks every replica (itself at priority 0, the others at 1): N x N
    # checks per interval. no_traffic_interval keeps the clusters of idle replicas quiet.
    return [
        HealthCheck(
            timeout=_seconds(0.5),
            interval=_seconds(1),
            no_traffic_interval=_seconds(5),
            unhealthy_threshold=1,
            healthy_threshold=2,
            http_health_check=HealthCheckHttpHealthCheck(path=spec.health_check_path),
        )
    ]


def _static_cluster(name: str, localities: list[LocalityLbEndpoints], dns: bool = False, **extra: Any) -> Cluster:
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS if dns else ClusterDiscoveryType.STATIC,
        connect_timeout=_seconds(1),
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        load_assignment=ClusterLoadAssignment(cluster_name=name, endpoints=localities),
        # Kubernetes DNS answers for a Service change as pods come and go; look again often.
        dns_refresh_rate=_seconds(2) if dns else None,
        # Envoy allows 3 concurrent retries per cluster by default: when a replica dies, every
        # request in flight to it fails at once and those past the third got a 503 (retry
        # overflow; benchmarks/fault_matrix.md). Retries here are only for connect failures and
        # resets, at most 2 per request, so the bound is raised to the default max_requests.
        circuit_breakers=CircuitBreakers(thresholds=[CircuitBreakersThresholds(max_retries=MAX_RETRIES)]),
        **extra,
    )


def _override_host_policy(spec: GatewaySpec) -> LoadBalancingPolicy:
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
                    typed_extension_config=_typed("envoy.load_balancing_policies.round_robin", RoundRobin())
                )
            ]
        ),
    )
    return LoadBalancingPolicy(
        policies=[
            LoadBalancingPolicyPolicy(
                typed_extension_config=_typed("envoy.load_balancing_policies.override_host", override)
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


def processor_cluster(name: str, addresses: Sequence[str], tls: ProcessorTls | None = None) -> Cluster:
    """The cluster of the processor(s): HTTP/2 (gRPC), TCP or unix sockets, TLS when ``tls``."""
    options = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http2_protocol_options=Http2ProtocolOptions())
    )
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=_seconds(1),
        lb_policy=ClusterLbPolicy.ROUND_ROBIN,
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[_endpoint(a) for a in addresses])]
        ),
        typed_extension_protocol_options={HTTP_OPTIONS: AnyMessage.pack(options)},
        transport_socket=processor_transport_socket(tls) if tls is not None else None,
    )


def _check(spec: GatewaySpec) -> None:
    if spec.mode not in ("cluster", "endpoint"):
        raise ValueError(f"mode: expected cluster or endpoint, got {spec.mode!r}")
    if spec.endpoint_cluster not in ("override_host", "original_dst"):
        raise ValueError(f"endpoint_cluster: expected override_host or original_dst, got {spec.endpoint_cluster!r}")
    if spec.replicas_dns is not None and spec.mode == "cluster":
        raise ValueError("replicas_dns: cluster mode needs one Envoy cluster per replica, so a static replica list")
    tries = spec.retries + 1
    if spec.stream_idle_timeout_s and spec.stream_idle_timeout_s <= spec.first_byte_timeout_s * tries:
        raise ValueError(
            f"stream_idle_timeout_s: {spec.stream_idle_timeout_s:g} s would end a stream still waiting for "
            f"its headers; it must exceed {tries} tries x first_byte_timeout_s {spec.first_byte_timeout_s:g} s"
        )
    if spec.replicas_dns is None and not spec.replicas:
        raise ValueError("replicas: none given (a replica list, or replicas_dns in endpoint mode)")


def bootstrap(spec: GatewaySpec) -> Bootstrap:
    """The bootstrap as a typed message; a wrong field or type raises here."""
    _check(spec)
    listeners = [_listener("gateway", spec.listen, _http_connection_manager(spec, "gateway", True))]
    if spec.round_robin_listen:
        listeners.append(
            _listener("round_robin", spec.round_robin_listen, _http_connection_manager(spec, "round_robin", False))
        )
    if spec.probe_listen:
        listeners.append(_listener("probe", spec.probe_listen, _probe_connection_manager()))
    dns = spec.replicas_dns is not None
    every = [_endpoint(spec.replicas_dns)] if spec.replicas_dns else [_endpoint(r.address) for r in spec.replicas]
    checks = _health_checks(spec)
    clusters = [
        _static_cluster(
            ROUND_ROBIN_CLUSTER,
            [LocalityLbEndpoints(lb_endpoints=every)],
            dns=dns,
            lb_policy=ClusterLbPolicy.ROUND_ROBIN,
            outlier_detection=_outlier_detection(),
            health_checks=checks,
        ),
        processor_cluster(PROCESSOR_CLUSTER, [spec.processor, *spec.extra_processors], spec.processor_tls),
    ]
    if spec.mode == "cluster":
        for replica in spec.replicas:
            others = [_endpoint(r.address) for r in spec.replicas if r.name != replica.name]
            localities = [LocalityLbEndpoints(lb_endpoints=[_endpoint(replica.address)], priority=0)]
            if others:
                localities.append(LocalityLbEndpoints(lb_endpoints=others, priority=1))
            clusters.append(
                _static_cluster(
                    replica.name,
                    localities,
                    lb_policy=ClusterLbPolicy.ROUND_ROBIN,
                    outlier_detection=_outlier_detection(),
                    health_checks=checks,
                )
            )
    elif spec.endpoint_cluster == "override_host":
        clusters.append(
            _static_cluster(
                OVERRIDE_HOST_CLUSTER,
                [LocalityLbEndpoints(lb_endpoints=every)],
                dns=dns,
                outlier_detection=_outlier_detection(),
                health_checks=checks,
                load_balancing_policy=_override_host_policy(spec),
            )
        )
    else:
        clusters.append(
            Cluster(
                name=ORIGINAL_DST_CLUSTER,
                type=ClusterDiscoveryType.ORIGINAL_DST,
                connect_timeout=_seconds(1),
                lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
                per_connection_buffer_limit_bytes=BUFFER_LIMIT,
                original_dst_lb_config=ClusterOriginalDstLbConfig(
                    use_http_header=True, http_header_name=spec.endpoint_header
                ),
            )
        )
    if spec.probe_listen:
        clusters.append(_static_cluster(ADMIN_CLUSTER, [LocalityLbEndpoints(lb_endpoints=[_endpoint(spec.admin)])]))
    return Bootstrap(
        admin=Admin(address=_address(spec.admin)),
        static_resources=BootstrapStaticResources(listeners=listeners, clusters=clusters),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, datetime.timedelta):
        return f"{value.total_seconds():g}s"
    if isinstance(value, enum.Enum):
        return value.name
    return value


def to_dict(message: betterproto2.Message) -> dict[str, Any]:
    """A message as Envoy's YAML form: snake_case fields, ``@type`` in every ``Any``.

    Built from betterproto2's Python output rather than its proto JSON, which quotes 64-bit
    integers (``'5'``); durations become ``"1s"`` and enums their names. Fields at their proto3
    default (``priority: 0``, ``response_body_mode: NONE`` ...) are left out, as Envoy's own
    printer does; Envoy reads them as those defaults.
    """
    plain: dict[str, Any] = _plain(
        message.to_dict(casing=betterproto2.Casing.SNAKE, output_format=betterproto2.OutputFormat.PYTHON)
    )
    return plain


def render(spec: GatewaySpec) -> dict[str, Any]:
    """The bootstrap as a mapping (dump it with :func:`render_yaml`), the admin section first."""
    rendered = to_dict(bootstrap(spec))
    return {"admin": rendered.pop("admin"), **rendered}


class _Dumper(yaml.SafeDumper):
    """No ``&id001`` anchors: each repeated block is written out, as a person would."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Mapping[str, Any] | Sequence[Any]) -> str:
    """YAML text in the form of the files we ship (keys in proto field order, no anchors)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120)


def render_yaml(spec: GatewaySpec) -> str:
    """The bootstrap as YAML text."""
    return dump_yaml(render(spec))


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
    messages too). The patches: the header_mutation and ext_proc filters inserted before the
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
        message_timeout_ms=spec.message_timeout_ms,
        observe_responses=spec.observe_responses,
    )
    before_router = {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {"name": HCM_FILTER, "subFilter": {"name": ROUTER_FILTER}}}},
    }
    patches = [
        # Two INSERT_BEFORE the router, applied in order: header_mutation, ext_proc, router.
        {
            "applyTo": "HTTP_FILTER",
            "match": before_router,
            "patch": {"operation": "INSERT_BEFORE", "value": to_dict(header_mutation_filter(gateway))},
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
                        load_balancing_policy=_override_host_policy(gateway),
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


# The ``extproc envoy-config`` command (its arguments are declared in extproc.cli, which imports
# this module only for that command, so ``extproc serve`` never loads envoy_data_plane).

OUTPUTS = ("bootstrap", "istio-envoyfilter")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def _loopback(address: str) -> str:
    """The address to connect to a server that listens on ``address`` from the same host."""
    if address.startswith("unix:"):
        return address
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else address


def _replicas_dns(cfg: Config) -> str | None:
    """The replicas' DNS name from the ``discovery:`` section (None when they are static)."""
    source = cfg.discovery.source
    if isinstance(source, KubernetesSource):
        if source.namespace is None or source.port is None:
            raise ConfigError(
                "discovery: Envoy needs the Service's DNS name and port: give discovery.namespace and "
                "discovery.port, or --replicas-dns HOST:PORT"
            )
        return dns_address(source.service, source.namespace, source.port)
    if isinstance(source, DnsSource):
        if source.record == "SRV" or source.port is None:
            raise ConfigError("discovery: Envoy cannot follow SRV records here; give --replicas-dns HOST:PORT")
        return f"{source.name}:{source.port}"
    return None


def _router_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config) if args.config else Config()
    replicas = tuple(parse_replica(s) for s in args.replica) or None
    return with_overrides(cfg, replicas=replicas, mode=args.mode)


def spec_from_args(args: argparse.Namespace) -> GatewaySpec:
    """The spec for ``envoy-config``: flags win over the scenario, which wins over the defaults.

    The mode, headers and replicas come from the router's own config, so the rendered Envoy
    config and the processor agree; a scenario whose mode contradicts the config is an error.
    """
    if args.scenario and args.scenario not in SCENARIOS:
        raise ConfigError(f"--scenario: expected one of {', '.join(SCENARIOS)}, got {args.scenario!r}")
    if args.output not in OUTPUTS:
        raise ConfigError(f"--output: expected one of {', '.join(OUTPUTS)}, got {args.output!r}")
    cfg = _router_config(args)
    scenario = SCENARIOS[args.scenario] if args.scenario else Scenario("default", "")
    mode = args.mode or (scenario.mode if args.scenario else cfg.mode)
    if args.config and args.scenario and cfg.mode != scenario.mode and not args.mode:
        raise ConfigError(f"mode: scenario {scenario.name} needs mode {scenario.mode}, the config has {cfg.mode}")
    processor = args.processor or (_loopback(cfg.listen) if args.config else scenario.processor)
    replicas_dns = args.replicas_dns or (None if cfg.replicas else _replicas_dns(cfg))
    return scenario.spec(
        cfg.replicas,
        mode=mode,
        processor=processor,
        listen=args.listen,
        admin=args.admin,
        endpoint_cluster=args.endpoint_cluster,
        health_check_path=args.health_check_path,
        probe_listen=args.probe_listen,
        round_robin_listen=args.round_robin_listen,
        replicas_dns=replicas_dns,
        cluster_header=cfg.target_cluster_header,
        endpoint_header=cfg.destination_endpoint_header,
        processor_tls=_processor_tls(args),
        first_byte_timeout_s=cfg.upstream.first_byte_s,
        stream_idle_timeout_s=cfg.upstream.stream_idle_s,
        stream_header=cfg.upstream.stream_header,
    )


def _processor_tls(args: argparse.Namespace) -> ProcessorTls | None:
    """``--processor-ca`` (``--processor-cert``, ``--processor-key``, ``--processor-server-name``)."""
    names = ("processor_ca", "processor_cert", "processor_key", "processor_server_name")
    ca, cert, key, server_name = (getattr(args, n, None) for n in names)
    if not (ca or cert or key or server_name):
        return None
    if not ca:
        raise ConfigError("--processor-ca: TLS to the processor needs the CA that signed its certificate")
    if bool(cert) != bool(key):
        raise ConfigError("--processor-cert and --processor-key: give both (Envoy's client certificate for mTLS)")
    return ProcessorTls(ca, cert, key, server_name)


def run_envoy_config(args: argparse.Namespace, out: TextIO) -> int:
    """``extproc envoy-config``: write the YAML to ``out``; a bad value raises ConfigError."""
    spec = spec_from_args(args)
    try:
        if args.output == "istio-envoyfilter":
            if spec.mode != "endpoint":
                raise ConfigError("mode: the Istio EnvoyFilter needs the processor in endpoint mode")
            if spec.replicas_dns is None or spec.processor.startswith("unix:"):
                raise ConfigError(
                    "istio-envoyfilter: needs the replicas' Service (discovery or --replicas-dns) and "
                    "--processor HOST:PORT of the processor's Service"
                )
            host, _, port = spec.replicas_dns.rpartition(":")
            istio = IstioSpec(
                processor_service=spec.processor,
                replicas_service=host,
                replicas_port=int(port),
                namespace=args.istio_namespace,
                endpoint_header=spec.endpoint_header,
                cluster_header=spec.cluster_header,
            )
            out.write(dump_yaml(istio_envoy_filter(istio)))
        else:
            out.write(render_yaml(spec))
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    return 0
