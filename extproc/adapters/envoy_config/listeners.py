"""Listeners, their HTTP connection managers and routes (with the retry policy each route uses)."""

from __future__ import annotations

from typing import Any

from envoy_data_plane.envoy.config.core.v3 import (
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
)
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
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
)
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.extensions.retry.priority.previous_priorities.v3 import PreviousPrioritiesConfig
from envoy_data_plane.google.protobuf import Any as AnyMessage

from extproc.adapters.envoy_config.access_log import access_logs
from extproc.adapters.envoy_config.filters import (
    early_mutations,
    ext_proc_filter,
    header_mutation_filter,
    router_filter,
    tracing,
)
from extproc.adapters.envoy_config.spec import (
    ADMIN_CLUSTER,
    ADMIN_PATHS,
    BUFFER_LIMIT,
    HCM_FILTER,
    ORIGINAL_DST_CLUSTER,
    OVERRIDE_HOST_CLUSTER,
    ROUND_ROBIN_CLUSTER,
    GatewaySpec,
)
from extproc.adapters.envoy_config.values import duration, envoy_address
from extproc.base.upstream_timeouts import ANSWERED_BY_HEADER


def _retry_policy(retries: int, across_priorities: bool, per_try_timeout_s: float | None = None) -> RetryPolicy:
    # "reset" also covers a try that met its per-try (first-byte) timeout: Envoy resets it and, as
    # nothing has gone to the client yet, tries another host. Not 5xx: a replica's own 503 is an
    # answer (overloaded), and resending the request there or elsewhere is the processor's call.
    return RetryPolicy(
        retry_on="connect-failure,refused-stream,reset",
        num_retries=retries,
        per_try_timeout=duration(per_try_timeout_s) if per_try_timeout_s else None,
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


def _routes(spec: GatewaySpec, with_processor: bool) -> list[Route]:
    timeout = duration(spec.route_timeout_s + spec.queue_wait_s)
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
            "idle_timeout": duration(idle_s) if idle_s else None,
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


def http_connection_manager(spec: GatewaySpec, name: str, with_processor: bool) -> Filter:
    """The gateway's (or, without the processor, the round-robin baseline's) connection manager."""
    filters = [header_mutation_filter(spec)]
    if with_processor:
        filters.append(ext_proc_filter(spec))
    filters.append(router_filter())
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
        early_header_mutation_extensions=early_mutations(spec),
        access_log=access_logs(spec, with_processor),
    )
    return Filter(name=HCM_FILTER, typed_config=AnyMessage.pack(hcm))


def probe_connection_manager() -> Filter:
    """The probe listener's connection manager: only the admin paths of ``ADMIN_PATHS`` (readiness, metrics)."""
    routes = [
        Route(match=RouteMatch(path=path), route=RouteAction(cluster=ADMIN_CLUSTER, timeout=duration(5)))
        for path in ADMIN_PATHS
    ]
    hcm = HttpConnectionManager(
        stat_prefix="probe",
        route_config=RouteConfiguration(
            name="probe", virtual_hosts=[VirtualHost(name="admin", domains=["*"], routes=routes)]
        ),
        http_filters=[router_filter()],
    )
    return Filter(name=HCM_FILTER, typed_config=AnyMessage.pack(hcm))


def listener(name: str, address: str, network_filter: Filter) -> Listener:
    """A listener on ``address`` with one network filter."""
    return Listener(
        name=name,
        address=envoy_address(address),
        per_connection_buffer_limit_bytes=BUFFER_LIMIT,
        filter_chains=[FilterChain(filters=[network_filter])],
    )
