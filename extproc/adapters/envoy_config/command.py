"""``extproc envoy-config``: flags and a router config to a rendered bootstrap or EnvoyFilter."""

from __future__ import annotations

import argparse
from typing import TextIO

from extproc.adapters.envoy_config.istio import IstioSpec, dns_address, istio_envoy_filter, istio_header_strip
from extproc.adapters.envoy_config.rendering import dump_yaml, render_yaml
from extproc.adapters.envoy_config.spec import SCENARIOS, GatewaySpec, ProcessorTls, Scenario
from extproc.config import Config, ConfigError, load_config, parse_replica, with_overrides
from extproc.fleet.discovery.settings import DnsSource, KubernetesSource

OUTPUTS = ("bootstrap", "istio-envoyfilter", "istio-header-strip")
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
"""The label Istio puts on a Gateway API Gateway's pods."""
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def _loopback(address: str) -> str:
    """The address to connect to a server that listens on ``address`` from the same host."""
    if address.startswith("unix:"):
        return address
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else address


def _replicas_dns(cfg: Config) -> str | None:
    """The replicas' DNS name from the ``discovery:`` section (None when they are static)."""
    source = cfg.discovery
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
        cluster_header=cfg.headers.target_cluster,
        endpoint_header=cfg.headers.destination_endpoint,
        processor_tls=_processor_tls(args),
        first_byte_timeout_s=cfg.upstream.first_byte_s,
        stream_idle_timeout_s=cfg.upstream.stream_idle_s,
        stream_header=cfg.upstream.stream_header,
        identity_headers=cfg.identity_headers,
        queue_wait_s=cfg.queueing.longest_wait_s,
        processor_streams_per_connection=1 if cfg.workers > 1 else None,
        access_log=getattr(args, "access_log", None),
        **_tracing(args, cfg),
    )


def _tracing(args: argparse.Namespace, cfg: Config) -> dict[str, object]:
    """``--tracing-collector`` and its sampling: by default the share the processor samples
    (``tracing.sample_rate``), since Envoy then decides for both."""
    collector = getattr(args, "tracing_collector", None)
    percent = getattr(args, "tracing_sample_percent", None)
    if collector is None:
        if percent is not None:
            raise ConfigError("--tracing-sample-percent: needs --tracing-collector")
        return {}
    if percent is None:
        percent = cfg.tracing.sample_rate * 100
    # Envoy follows a client's sampled parent only where the operator's sampler does.
    follow = cfg.tracing.sampler == "parent_based"
    return {"tracing_collector": collector, "tracing_sample_percent": percent, "tracing_client_parent": follow}


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
        if args.output == "istio-header-strip":
            gateway = getattr(args, "istio_gateway", None)
            labels = {GATEWAY_NAME_LABEL: gateway} if gateway else IstioSpec("", "", 0).gateway_labels
            strip = IstioSpec(
                processor_service="",
                replicas_service="",
                replicas_port=0,
                namespace=args.istio_namespace,
                name="extproc-header-strip",
                endpoint_header=spec.endpoint_header,
                cluster_header=spec.cluster_header,
                identity_headers=spec.identity_headers,
                gateway_labels=labels,
            )
            out.write(dump_yaml(istio_header_strip(strip)))
        elif args.output == "istio-envoyfilter":
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
                identity_headers=spec.identity_headers,
            )
            out.write(dump_yaml(istio_envoy_filter(istio)))
        else:
            out.write(render_yaml(spec))
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    return 0
