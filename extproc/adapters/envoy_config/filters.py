"""The HTTP filters of the gateway's chain (header mutation, ext_proc, router), the headers they
strip from a client's request before Envoy reads them, and Envoy's own tracing."""

from __future__ import annotations

import datetime
import math

from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as HeaderMutationRule
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import (
    GrpcService,
    GrpcServiceEnvoyGrpc,
    TypedExtensionConfig,
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
    HttpConnectionManagerTracing,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    HeaderMutation as EarlyHeaderMutation,
)
from envoy_data_plane.envoy.type.v3 import Percent
from envoy_data_plane.google.protobuf import Any as AnyMessage

from extproc.adapters.envoy_config.spec import (
    CLIENT_TRACE_ID_HEADER,
    EARLY_HEADER_MUTATION,
    EXT_PROC_FILTER,
    FORCE_TRACE_HEADER,
    HEADER_MUTATION_FILTER,
    OPENTELEMETRY_TRACER,
    PROCESSOR_CLUSTER,
    REQUEST_ID_HEADER,
    ROUTER_FILTER,
    TRACE_CONTEXT_HEADERS,
    TRACING_CLUSTER,
    TRACING_SERVICE_NAME,
    GatewaySpec,
)
from extproc.base.upstream_timeouts import ANSWERED_BY_HEADER, PER_TRY_TIMEOUT_HEADER
from extproc.request.kv_transfer import PREFILLER_HEADER


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


def router_filter() -> HttpFilter:
    """The router filter, last in every chain."""
    return HttpFilter(name=ROUTER_FILTER, typed_config=AnyMessage.pack(Router()))


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


def early_mutations(spec: GatewaySpec) -> list[TypedExtensionConfig]:
    """The trusted headers (and the trace-forcing ones) removed before Envoy does anything with
    the request: Envoy picks a request's route before the first filter runs, and keeps it unless a
    filter changes headers the way ext_proc does; with the processor down (failing open) the
    route a client's ``x-target-cluster`` chose would stand though the first filter removed it
    (measured: every request on the named replica)."""
    names = tuple(dict.fromkeys((*stripped_headers(spec), *trace_forcing_headers(spec))))
    mutation = EarlyHeaderMutation(mutations=[HeaderMutationRule(remove=name) for name in names])
    return [TypedExtensionConfig(name=EARLY_HEADER_MUTATION, typed_config=AnyMessage.pack(mutation))]
