"""The whole bootstrap, checked, from a :class:`~extproc.adapters.envoy_config.spec.GatewaySpec`: its
listeners (:mod:`.listeners`, with the filters of :mod:`.filters`) and clusters (:mod:`.clusters`)."""

from __future__ import annotations

from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    Cluster,
    ClusterDiscoveryType,
    ClusterLbPolicy,
    ClusterOriginalDstLbConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import LocalityLbEndpoints

from extproc.adapters.envoy_config.clusters import (
    collector_cluster,
    health_checks,
    outlier_detection,
    override_host_policy,
    processor_cluster,
    static_cluster,
)
from extproc.adapters.envoy_config.listeners import http_connection_manager, listener, probe_connection_manager
from extproc.adapters.envoy_config.spec import (
    ADMIN_CLUSTER,
    BUFFER_LIMIT,
    ORIGINAL_DST_CLUSTER,
    OVERRIDE_HOST_CLUSTER,
    PROCESSOR_CLUSTER,
    ROUND_ROBIN_CLUSTER,
    GatewaySpec,
)
from extproc.adapters.envoy_config.values import duration, envoy_address, lb_endpoint


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
    listeners = [listener("gateway", spec.listen, http_connection_manager(spec, "gateway", True))]
    if spec.round_robin_listen:
        listeners.append(
            listener("round_robin", spec.round_robin_listen, http_connection_manager(spec, "round_robin", False))
        )
    if spec.probe_listen:
        listeners.append(listener("probe", spec.probe_listen, probe_connection_manager()))
    dns = spec.replicas_dns is not None
    every = [lb_endpoint(spec.replicas_dns)] if spec.replicas_dns else [lb_endpoint(r.address) for r in spec.replicas]
    checks = health_checks(spec)
    clusters = [
        static_cluster(
            ROUND_ROBIN_CLUSTER,
            [LocalityLbEndpoints(lb_endpoints=every)],
            dns=dns,
            lb_policy=ClusterLbPolicy.ROUND_ROBIN,
            outlier_detection=outlier_detection(),
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
            others = [lb_endpoint(r.address) for r in spec.replicas if r.name != replica.name]
            localities = [LocalityLbEndpoints(lb_endpoints=[lb_endpoint(replica.address)], priority=0)]
            if others:
                localities.append(LocalityLbEndpoints(lb_endpoints=others, priority=1))
            clusters.append(
                static_cluster(
                    replica.name,
                    localities,
                    lb_policy=ClusterLbPolicy.ROUND_ROBIN,
                    outlier_detection=outlier_detection(),
                    health_checks=checks,
                )
            )
    elif spec.endpoint_cluster == "override_host":
        clusters.append(
            static_cluster(
                OVERRIDE_HOST_CLUSTER,
                [LocalityLbEndpoints(lb_endpoints=every)],
                dns=dns,
                outlier_detection=outlier_detection(),
                health_checks=checks,
                load_balancing_policy=override_host_policy(spec),
            )
        )
    else:
        clusters.append(
            Cluster(
                name=ORIGINAL_DST_CLUSTER,
                type=ClusterDiscoveryType.ORIGINAL_DST,
                connect_timeout=duration(1),
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
        clusters.append(static_cluster(ADMIN_CLUSTER, [LocalityLbEndpoints(lb_endpoints=[lb_endpoint(spec.admin)])]))
    return Bootstrap(
        admin=Admin(address=envoy_address(spec.admin)),
        static_resources=BootstrapStaticResources(listeners=listeners, clusters=clusters),
    )
