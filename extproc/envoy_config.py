"""Envoy bootstrap configs for the gateway, rendered from the router's replica list.

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
  balancing policy, which takes the header, then the metadata list, then round robin; retries
  of connect failures and resets go to another host, so a dead pod costs no client error.
  ``original_dst``: an ``ORIGINAL_DST`` cluster connects to whatever address the header names,
  for fleets Envoy does not know; a retry goes to the same address, so a dead pod's requests
  fail over only after the processor ejects it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from extproc.routing.model import Replica

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
PREVIOUS_PRIORITIES = (
    "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig"
)
PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
ROUND_ROBIN_CLUSTER = "replicas_round_robin"
ORIGINAL_DST_CLUSTER = "replicas_original_dst"
OVERRIDE_HOST_CLUSTER = "replicas_endpoint"
OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
ROUND_ROBIN_POLICY = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
PROCESSOR_CLUSTER = "extproc"
BUFFER_LIMIT = 16 * 1024 * 1024


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
    observe_responses: bool = True


def _socket(address: str) -> dict[str, Any]:
    if address.startswith("unix:"):
        return {"pipe": {"path": address[len("unix:") :]}}
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _endpoint(address: str) -> dict[str, Any]:
    return {"endpoint": {"address": _socket(address)}}


def _retry_policy(retries: int, across_priorities: bool) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "retry_on": "connect-failure,refused-stream,reset",
        "num_retries": retries,
        "retry_host_predicate": [
            {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {"@type": PREVIOUS_HOSTS}}
        ],
        "host_selection_retry_max_attempts": 5,
    }
    if across_priorities:
        policy["retry_priority"] = {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {"@type": PREVIOUS_PRIORITIES, "update_frequency": 1},
        }
    return policy


def _http_connection_manager(spec: GatewaySpec, name: str, with_processor: bool) -> dict[str, Any]:
    default_route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": ROUND_ROBIN_CLUSTER,
            "timeout": f"{spec.route_timeout_s}s",
            "retry_policy": _retry_policy(spec.retries, across_priorities=False),
        },
    }
    routes: list[dict[str, Any]] = []
    if with_processor:
        header = spec.cluster_header if spec.mode == "cluster" else spec.endpoint_header
        target: dict[str, Any]
        if spec.mode == "cluster":
            target = {"cluster_header": spec.cluster_header}
        elif spec.endpoint_cluster == "original_dst":
            target = {"cluster": ORIGINAL_DST_CLUSTER}
        else:
            target = {"cluster": OVERRIDE_HOST_CLUSTER}
        target["timeout"] = f"{spec.route_timeout_s}s"
        if spec.mode == "cluster" or spec.endpoint_cluster != "original_dst":
            target["retry_policy"] = _retry_policy(spec.retries, across_priorities=spec.mode == "cluster")
        routes.append({"match": {"prefix": "/", "headers": [{"name": header, "present_match": True}]}, "route": target})
    routes.append(default_route)
    filters: list[dict[str, Any]] = [
        {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {
                "@type": HEADER_MUTATION,
                "mutations": {"request_mutations": [{"remove": spec.cluster_header}, {"remove": spec.endpoint_header}]},
            },
        }
    ]
    if with_processor:
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": EXT_PROC,
                    "grpc_service": {"envoy_grpc": {"cluster_name": PROCESSOR_CLUSTER}},
                    "failure_mode_allow": True,
                    "message_timeout": f"{spec.message_timeout_ms / 1000:g}s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "request_body_mode": "BUFFERED",
                        "response_header_mode": "SEND" if spec.observe_responses else "SKIP",
                        "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_trailer_mode": "SKIP",
                    },
                },
            }
        )
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}})
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": HCM,
            "stat_prefix": name,
            "generate_request_id": True,
            "route_config": {
                "name": name,
                "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes}],
            },
            "http_filters": filters,
        },
    }


def _listener(name: str, address: str, hcm: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "address": _socket(address),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT,
        "filter_chains": [{"filters": [hcm]}],
    }


def _cluster(name: str, endpoints: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT,
        "load_assignment": {"cluster_name": name, "endpoints": endpoints},
    }
    cluster.update(extra)
    return cluster


_OUTLIER = {"consecutive_gateway_failure": 3, "interval": "1s", "base_ejection_time": "5s", "max_ejection_percent": 50}


def _override_host(spec: GatewaySpec) -> dict[str, Any]:
    # The metadata first: it carries the fallbacks after the chosen pod; the header has only the pod.
    return {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": OVERRIDE_HOST,
            "override_host_sources": [
                {"metadata": {"key": "envoy.lb", "path": [{"key": spec.endpoint_header}]}},
                {"header": spec.endpoint_header},
            ],
            "fallback_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.round_robin",
                            "typed_config": {"@type": ROUND_ROBIN_POLICY},
                        }
                    }
                ]
            },
        },
    }


def render(spec: GatewaySpec) -> dict[str, Any]:
    """The bootstrap as a mapping (dump it with :func:`render_yaml`)."""
    if spec.mode not in ("cluster", "endpoint"):
        raise ValueError(f"mode: expected cluster or endpoint, got {spec.mode!r}")
    if spec.endpoint_cluster not in ("override_host", "original_dst"):
        raise ValueError(f"endpoint_cluster: expected override_host or original_dst, got {spec.endpoint_cluster!r}")
    listeners = [_listener("gateway", spec.listen, _http_connection_manager(spec, "gateway", True))]
    if spec.round_robin_listen:
        listeners.append(
            _listener("round_robin", spec.round_robin_listen, _http_connection_manager(spec, "round_robin", False))
        )
    every = [_endpoint(r.address) for r in spec.replicas]
    clusters = [
        _cluster(ROUND_ROBIN_CLUSTER, [{"lb_endpoints": every}], outlier_detection=_OUTLIER),
        _cluster(
            PROCESSOR_CLUSTER,
            [{"lb_endpoints": [_endpoint(spec.processor)]}],
            typed_extension_protocol_options={
                HTTP_OPTIONS: {"@type": HTTP_OPTIONS_TYPE, "explicit_http_config": {"http2_protocol_options": {}}}
            },
        ),
    ]
    if spec.mode == "cluster":
        for replica in spec.replicas:
            others = [_endpoint(r.address) for r in spec.replicas if r.name != replica.name]
            endpoints: list[dict[str, Any]] = [{"lb_endpoints": [_endpoint(replica.address)], "priority": 0}]
            if others:
                endpoints.append({"lb_endpoints": others, "priority": 1})
            clusters.append(_cluster(replica.name, endpoints, outlier_detection=_OUTLIER))
    elif spec.endpoint_cluster != "original_dst":
        clusters.append(
            _cluster(
                OVERRIDE_HOST_CLUSTER,
                [{"lb_endpoints": every}],
                outlier_detection=_OUTLIER,
                load_balancing_policy={"policies": [{"typed_extension_config": _override_host(spec)}]},
            )
        )
        del clusters[-1]["lb_policy"]
    else:
        clusters.append(
            {
                "name": ORIGINAL_DST_CLUSTER,
                "type": "ORIGINAL_DST",
                "connect_timeout": "1s",
                "lb_policy": "CLUSTER_PROVIDED",
                "per_connection_buffer_limit_bytes": BUFFER_LIMIT,
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": spec.endpoint_header},
            }
        )
    return {
        "admin": {"address": _socket(spec.admin)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def render_yaml(spec: GatewaySpec) -> str:
    """The bootstrap as YAML text."""
    return yaml.safe_dump(render(spec), sort_keys=False, width=120)
