"""What a gateway is made of: the replicas, the mode, the listeners, and the named scenarios
(presets) shipped under ``envoy/`` and ``k8s/``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extproc.base.upstream_timeouts import UpstreamTimeouts
from extproc.request.tenant import TENANT_HEADER
from extproc.routing.model import Replica

HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
ROUND_ROBIN_CLUSTER = "replicas_round_robin"
ORIGINAL_DST_CLUSTER = "replicas_original_dst"
OVERRIDE_HOST_CLUSTER = "replicas_endpoint"
PROCESSOR_CLUSTER = "extproc"
ADMIN_CLUSTER = "envoy_admin"
TRACING_CLUSTER = "otel_collector"
OPENTELEMETRY_TRACER = "envoy.tracers.opentelemetry"
TRACING_SERVICE_NAME = "envoy-gateway"
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")
"""W3C trace context a client may send (removed at the edge under Envoy's own tracing)."""
REQUEST_ID_HEADER = "x-request-id"
CLIENT_TRACE_ID_HEADER = "x-client-trace-id"
FORCE_TRACE_HEADER = "x-envoy-force-trace"
EARLY_HEADER_MUTATION = "envoy.http.early_header_mutation.header_mutation"
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
    # The longest a processor may hold a request while the fleet is full (config
    # ``queueing:``): added to the ext_proc message timeout, which would otherwise fail the held
    # request open to round robin, and to the route timeout.
    queue_wait_s: float = 0.0
    retries: int = 2
    # Per try (config ``upstream:``): a try without response headers after first_byte_timeout_s is
    # retried on another replica; a stream silent for stream_idle_timeout_s is ended. The
    # processor marks streams with stream_header and gives non-streaming requests their own bound.
    first_byte_timeout_s: float = UpstreamTimeouts().first_byte_s
    stream_idle_timeout_s: float = UpstreamTimeouts().stream_idle_s
    stream_header: str = UpstreamTimeouts().stream_header
    # Headers that say who a request is (config ``tenants.header``): a client's is stripped before
    # any filter, so only the gateway's own authentication, placed after the strip, can set them.
    identity_headers: tuple[str, ...] = (TENANT_HEADER,)
    observe_responses: bool = True
    full_duplex: bool = False
    # More processors sharing one affinity store (active-active): Envoy round-robins streams.
    extra_processors: tuple[str, ...] = ()
    # ext_proc streams Envoy multiplexes on one connection to the processor (None: HTTP/2's own
    # limit). A processor with several workers (`serve --workers`) shares its port by
    # SO_REUSEPORT, which spreads connections, not streams: one stream a connection spreads them.
    processor_streams_per_connection: int | None = None
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
    # HOST:PORT of an OTLP/gRPC collector (plaintext): Envoy's own spans for the requests it samples
    # (tracing_sample_percent of those that arrive without a sampled traceparent). The processor
    # and the replica join the same trace through the context Envoy propagates.
    tracing_collector: str | None = None
    tracing_sample_percent: float = 100.0
    # With Envoy's tracing: whether Envoy joins a client's trace (the processor's sampler
    # parent_based) when it samples the request; without, the client's traceparent and
    # tracestate are removed before Envoy reads them (bootstrap.trace_forcing_headers).
    tracing_client_parent: bool = False
    # A file (or /dev/stdout) for Envoy's access log: a JSON line a request with where its time
    # went before the replica answered, the processor's share by message (access_log.py).
    access_log: str | None = None


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
