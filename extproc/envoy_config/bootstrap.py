"""Typed builders: filters, routes, listeners and clusters, and the whole bootstrap, from a
:class:`~extproc.envoy_config.spec.GatewaySpec`."""

from __future__ import annotations

import datetime
import ipaddress
import math
from collections.abc import Sequence
from typing import Any

import betterproto2
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
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
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
    HedgePolicy,
    RetryPolicy,
    RetryPolicyRetryHostPredicate,
    RetryPolicyRetryPriority,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.config.trace.v3 import OpenTelemetryConfig, TracingHttp
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
    HttpConnectionManagerTracing,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    HeaderMutation as EarlyHeaderMutation,
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
from envoy_data_plane.envoy.type.v3 import Percent
from envoy_data_plane.google.protobuf import Any as AnyMessage

from extproc.envoy_config.spec import (
    ADMIN_CLUSTER,
    ADMIN_PATHS,
    BUFFER_LIMIT,
    CLIENT_TRACE_ID_HEADER,
    EARLY_HEADER_MUTATION,
    EXT_PROC_FILTER,
    FORCE_TRACE_HEADER,
    HCM_FILTER,
    HEADER_MUTATION_FILTER,
    HTTP_OPTIONS,
    MAX_RETRIES,
    OPENTELEMETRY_TRACER,
    ORIGINAL_DST_CLUSTER,
    OVERRIDE_HOST_CLUSTER,
    PROCESSOR_CLUSTER,
    REQUEST_ID_HEADER,
    ROUND_ROBIN_CLUSTER,
    ROUTER_FILTER,
    TRACE_CONTEXT_HEADERS,
    TRACING_CLUSTER,
    TRACING_SERVICE_NAME,
    GatewaySpec,
    ProcessorTls,
)
from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc.upstream_timeouts import ANSWERED_BY_HEADER, PER_TRY_TIMEOUT_HEADER


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


def stripped_headers(spec: GatewaySpec) -> tuple[str, ...]:
    """Every request header the router trusts, stripped from a client's request by the first
    filter: the routing headers (the processor sets them) and the identity headers (only the
    gateway's own authentication, after the strip, may set them)."""
    names = (
        spec.cluster_header,
        spec.endpoint_header,
        spec.stream_header,
        PER_TRY_TIMEOUT_HEADER,
        # Past a processor that is down (failure_mode_allow), a decode replica's sidecar
        # would otherwise make a prefill hop to wherever the client said.
        PREFILLER_HEADER,
        *spec.identity_headers,
    )
    return tuple(dict.fromkeys(names))


def header_mutation_filter(spec: GatewaySpec) -> HttpFilter:
    """Strips the headers the router trusts from a client's request (:func:`stripped_headers`),
    before ext_proc runs, and the answering replica's address from the response, after ext_proc
    has read it (the first filter of the chain is the last on the way back)."""
    removals = [HeaderMutationRule(remove=name) for name in stripped_headers(spec)]
    mutations = Mutations(
        request_mutations=removals, response_mutations=[HeaderMutationRule(remove=ANSWERED_BY_HEADER)]
    )
    return HttpFilter(name=HEADER_MUTATION_FILTER, typed_config=AnyMessage.pack(HeaderMutation(mutations=mutations)))


def ext_proc_filter(spec: GatewaySpec, cluster: str = PROCESSOR_CLUSTER) -> HttpFilter:
    """The ext_proc filter: headers and the buffered body to the processor, failing open."""
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster)),
        failure_mode_allow=True,
        message_timeout=datetime.timedelta(milliseconds=spec.message_timeout_ms + math.ceil(spec.queue_wait_s * 1000)),
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
    timeout = _seconds(spec.route_timeout_s + spec.queue_wait_s)
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

    def target(idle_s: float | None, hedge: bool) -> RouteAction:
        first_byte_s = spec.first_byte_timeout_s
        extra: dict[str, Any] = {
            "timeout": timeout,
            "idle_timeout": _seconds(idle_s) if idle_s else None,
            # A non-streaming try's budget (x-envoy-upstream-rq-per-try-timeout-ms, from its
            # max_tokens) cannot tell a hung replica from one still generating: both are silent
            # until the answer is done. So its timeout hedges: the request goes to another
            # replica too, the first try keeps running, the first answer wins.
            "hedge_policy": HedgePolicy(hedge_on_per_try_timeout=True) if hedge else None,
        }
        if spec.mode == "cluster":
            policy = _retry_policy(spec.retries, True, first_byte_s)
            return RouteAction(cluster_header=spec.cluster_header, retry_policy=policy, **extra)
        if spec.endpoint_cluster == "original_dst":
            # No retries: a retry would go to the same address the header names. The per-try
            # bound still ends a hung pod's stream in seconds rather than at the route timeout
            # (a non-streaming request, with nowhere to hedge to, waits for its answer).
            policy = _retry_policy(0, False, first_byte_s)
            return RouteAction(cluster=ORIGINAL_DST_CLUSTER, retry_policy=policy, **extra)
        policy = _retry_policy(spec.retries, False, first_byte_s)
        return RouteAction(cluster=OVERRIDE_HOST_CLUSTER, retry_policy=policy, **extra)

    # The address of the replica whose answer Envoy returns: after a hedge the processor learns
    # from it whether its choice answered (slowly) or failed and another replica answered.
    answered_by = [
        HeaderValueOption(
            header=HeaderValue(key=ANSWERED_BY_HEADER, value="%UPSTREAM_REMOTE_ADDRESS%"),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    ]
    routed = [HeaderMatcher(name=header, present_match=True)]
    streaming = [*routed, HeaderMatcher(name=spec.stream_header, present_match=True)]
    return [
        # Streams first: only they get the idle timeout (a non-streaming answer is silent until
        # done), and their first-byte timeout resets the try (their headers come with the first
        # token, so a silent try is a stuck one). Envoy's route idle_timeout, not the retry
        # policy's per_try_idle_timeout, which (Envoy 1.40, tried) did not end a stream stalled
        # after its headers.
        Route(
            match=RouteMatch(prefix="/", headers=streaming),
            route=target(spec.stream_idle_timeout_s, hedge=False),
            response_headers_to_add=answered_by,
        ),
        Route(
            match=RouteMatch(prefix="/", headers=routed),
            route=target(None, hedge=True),
            response_headers_to_add=answered_by,
        ),
        default_route,
    ]


def tracing(spec: GatewaySpec) -> HttpConnectionManagerTracing | None:
    """Envoy's own spans over OTLP/gRPC to ``spec.tracing_collector`` (None without one).

    A span per request (the ingress span) and one per upstream try (``spawn_upstream_span``: a
    retry or a hedge is a span of its own, as for a gateway rather than a sidecar). Envoy starts
    the ext_proc stream as a child of the ingress span and puts that context in the stream's gRPC
    metadata, which is where the processor reads its parent when the client sent none; its
    router then writes the upstream span's ``traceparent`` into the request to the replica.
    """
    if spec.tracing_collector is None:
        return None
    otel = OpenTelemetryConfig(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=TRACING_CLUSTER)),
        service_name=TRACING_SERVICE_NAME,
    )
    return HttpConnectionManagerTracing(
        random_sampling=Percent(value=spec.tracing_sample_percent),
        # A client's x-client-trace-id would force a trace (Envoy's default: 100% of them).
        client_sampling=Percent(value=0.0),
        provider=TracingHttp(name=OPENTELEMETRY_TRACER, typed_config=AnyMessage.pack(otel)),
        spawn_upstream_span=True,
    )


def trace_forcing_headers(spec: GatewaySpec) -> tuple[str, ...]:
    """With Envoy's own tracing, the client's headers that would decide what Envoy traces,
    removed before Envoy reads them (an early header mutation: before its request id and its
    tracing decision, which precede every filter). Measured on Envoy 1.40 at 0%: a client's
    ``x-client-trace-id`` forced a trace (client_sampling, 100% by default), and so did its own
    ``x-request-id`` with the UUID's trace bits set (kept from an address Envoy deems internal:
    loopback, RFC 1918), while a sampled ``traceparent`` did not (random_sampling decided), its
    trace joined only when sampled. Without ``tracing_client_parent`` its trace context goes too,
    so Envoy's trace is its own, as the processor's is under its sampler ``ratio``."""
    if spec.tracing_collector is None:
        return ()
    names = (REQUEST_ID_HEADER, CLIENT_TRACE_ID_HEADER, FORCE_TRACE_HEADER)
    return names if spec.tracing_client_parent else (*names, *TRACE_CONTEXT_HEADERS)


def _early_mutations(spec: GatewaySpec) -> list[TypedExtensionConfig]:
    """The trusted headers (and the trace-forcing ones) removed before Envoy does anything with
    the request: Envoy picks a request's route before the first filter runs, and keeps it unless a
    filter changes headers the way ext_proc does; with the processor down (failing open) the
    route a client's ``x-target-cluster`` chose would stand though the first filter removed it
    (measured: every request on the named replica)."""
    names = tuple(dict.fromkeys((*stripped_headers(spec), *trace_forcing_headers(spec))))
    mutation = EarlyHeaderMutation(mutations=[HeaderMutationRule(remove=name) for name in names])
    return [TypedExtensionConfig(name=EARLY_HEADER_MUTATION, typed_config=AnyMessage.pack(mutation))]


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
        tracing=tracing(spec),
        early_header_mutation_extensions=_early_mutations(spec),
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
        connect_timeout=_seconds(1),
        lb_policy=ClusterLbPolicy.ROUND_ROBIN,
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[_endpoint(a) for a in addresses])]
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
        connect_timeout=_seconds(1),
        load_assignment=ClusterLoadAssignment(
            cluster_name=TRACING_CLUSTER, endpoints=[LocalityLbEndpoints(lb_endpoints=[_endpoint(address)])]
        ),
        typed_extension_protocol_options={HTTP_OPTIONS: AnyMessage.pack(options)},
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
    if spec.tracing_collector is not None:
        host, _, port = spec.tracing_collector.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"tracing_collector: expected HOST:PORT, got {spec.tracing_collector!r}")
    if not 0 <= spec.tracing_sample_percent <= 100:
        raise ValueError(f"tracing_sample_percent: expected 0 to 100, got {spec.tracing_sample_percent:g}")
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
        processor_cluster(
            PROCESSOR_CLUSTER,
            [spec.processor, *spec.extra_processors],
            spec.processor_tls,
            spec.processor_streams_per_connection,
        ),
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
                load_balancing_policy=override_host_policy(spec),
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
    if spec.tracing_collector is not None:
        clusters.append(collector_cluster(spec.tracing_collector))
    if spec.probe_listen:
        clusters.append(_static_cluster(ADMIN_CLUSTER, [LocalityLbEndpoints(lb_endpoints=[_endpoint(spec.admin)])]))
    return Bootstrap(
        admin=Admin(address=_address(spec.admin)),
        static_resources=BootstrapStaticResources(listeners=listeners, clusters=clusters),
    )
