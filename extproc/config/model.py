"""The router's config as one model: the YAML file's shape, validated once at start-up, and the
runtime value every subsystem reads (``config.sessions.ttl_s``, ``config.health.weights.queue``).

Each subsystem's section lives beside the subsystem (``HealthSettings`` in
:mod:`extproc.fleet.health.settings`, ``QueueSettings`` in :mod:`extproc.fleet.queueing.settings`, ...);
the sections no subsystem owns are in :mod:`extproc.config.sections`, the lists of entries in
:mod:`.replicas`, :mod:`.classes`, :mod:`.profiles` and :mod:`.splits`; this module composes the
root. Unknown keys are rejected in every section, types are strict (``"high"`` is not a number,
``true`` is not an integer), ranges are checked, and an error names the full path of the field
(``health.limits.queue_full``). ``examples/router.yaml`` is generated from these models
(:mod:`extproc.config.example`; a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Literal

from pydantic import field_validator, model_validator

from extproc.base.upstream_timeouts import UpstreamTimeouts
from extproc.base.validation import Section, option
from extproc.config.classes import ClassItem
from extproc.config.profiles import ProfileMapping
from extproc.config.replicas import ReplicaItem
from extproc.config.sections import (
    AdminSettings,
    Disaggregation,
    Grpc,
    Headers,
    Metrics,
    Prefix,
    Request,
    Ring,
    Sessions,
    Spillover,
)
from extproc.config.splits import SplitItem
from extproc.fleet.discovery.settings import DiscoverySettings, StaticSource
from extproc.fleet.health.settings import HealthSettings
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.queueing.settings import QueueSettings
from extproc.fleet.rebalance.rebalancer import RebalanceSettings
from extproc.observe.hotkeys.detector import HotKeySettings
from extproc.observe.tracing import TracingSettings
from extproc.request.features import FeatureSettings
from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc.request.splits import SplitRule
from extproc.routing.registry import DEFAULT_PROFILE, ProfileError, build_profile
from extproc.state.budgets.settings import BudgetSettings
from extproc.state.store_url import parse_store_url
from extproc.state.tenancy import TenantSettings

Mode = Literal["cluster", "endpoint"]


class Config(Section):
    """The whole file, and the router's runtime config. Every key is optional: ``extproc serve
    --replica ...`` runs without one."""

    listen: str = option("127.0.0.1:9002", "the ext_proc gRPC listener: HOST:PORT or unix:/path")
    mode: Mode = option("cluster", "cluster: a target-cluster header; endpoint: GIE's destination-endpoint header")
    headers: Headers = option(Headers(), "routing header names")
    replicas: tuple[ReplicaItem, ...] = option((), "static replicas (discovery may add more)", strict=False)
    discovery: DiscoverySettings = option(
        StaticSource(), "where members come from: type static (default), dns or kubernetes; see docs/configuration.md"
    )
    workers: int = option(1, "processes serving the ext_proc port, sharing state in memory (docs/performance.md)", ge=1)
    store: str = option(
        "memory://", "affinity store URL: memory://, redis://, rediss://, unix://, redis+sentinel://, ..."
    )
    sessions: Sessions = option(Sessions(), "session pins")
    request: Request = option(Request(), "session sources and body size")
    prefix: Prefix = option(Prefix(), "prefix hashing and index")
    ring: Ring = option(Ring(), "the consistent-hash ring")
    metrics: Metrics = option(Metrics(), "Prometheus /metrics")
    grpc: Grpc = option(Grpc(), "the gRPC listener")
    admin: AdminSettings = option(
        AdminSettings(), "the admin API, on the ext_proc port unless given its own (docs/ports.md)"
    )
    health: HealthSettings = option(HealthSettings(), "replica health and rotation")
    spillover: Spillover = option(Spillover(), "overloaded replicas")
    disaggregation: Disaggregation = option(Disaggregation(), "prefill/decode pairs, where replicas carry roles")
    upstream: UpstreamTimeouts = option(UpstreamTimeouts(), "how long Envoy waits for a replica")
    kv_events: KvEventSettings = option(KvEventSettings(), "vLLM's KV-cache events")
    rebalance: RebalanceSettings = option(RebalanceSettings(), "moving sessions")
    tenants: TenantSettings = option(TenantSettings(), "tenants and quotas")
    classes: tuple[ClassItem, ...] = option((), "request classes, first match wins", strict=False)
    profile: ProfileMapping = option(DEFAULT_PROFILE, "the routing profile (default: the shipped one)")
    profiles: dict[str, ProfileMapping] = option({}, "named profiles that classes may use")
    splits: tuple[SplitItem, ...] = option(
        (), "canary and A/B splits with model rewrites, first match wins", strict=False
    )
    queueing: QueueSettings = option(QueueSettings(), "priority and fair queueing when the fleet is full")
    hot_keys: HotKeySettings = option(HotKeySettings(), "hot-prefix detection and replication")
    tracing: TracingSettings = option(TracingSettings(), "OpenTelemetry spans of routing decisions")
    budgets: BudgetSettings = option(BudgetSettings(), "token metering; token budgets per tenant, API key and model")

    @field_validator("store")
    @classmethod
    def _store_url(cls, url: str) -> str:
        parse_store_url(url)  # the form only: Redis may well be down while we start
        return url

    @field_validator("splits")
    @classmethod
    def _split_names(cls, rules: tuple[SplitRule, ...]) -> tuple[SplitRule, ...]:
        named = tuple(r if r.name else dataclasses.replace(r, name=f"split-{i}") for i, r in enumerate(rules))
        names = [r.name for r in named]
        if len(set(names)) != len(names):
            raise ValueError("rule names must be unique")
        return named

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        # Checks whose messages carry their own paths (describe prints them as they are).
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("replicas: names must be unique")
        for i, rule in enumerate(self.classes):
            if rule.profile is not None and rule.profile not in self.profiles:
                raise ValueError(f"classes[{i}].profile: no profile {rule.profile!r} under profiles:")
        try:
            build_profile(self.profile)  # fail now, naming the field, rather than at the first request
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        for name, spec in self.profiles.items():
            try:
                build_profile(spec)
            except ProfileError as exc:
                raise ValueError(f"profiles.{name}: {exc}") from None
        if self.grpc.server == "grpclib" and self.admin.enabled and self.admin.listen in (None, self.listen):
            raise ValueError(
                "grpc.server: grpclib serves ext_proc and health only; give the admin API a port of its own "
                "(admin.listen) or turn it off (admin.listen: 'off')"
            )
        return self

    @cached_property
    def features(self) -> FeatureSettings:
        """What feature extraction reads, gathered once from ``request:``, ``prefix:``,
        ``tenants:`` and ``classes:`` (the request layer sees no config)."""
        return FeatureSettings(
            session_sources=self.request.session_sources,
            # A client's claim is no identity: the header counts only when the gateway sets it.
            tenant_header=self.tenants.header if self.tenants.trust_header else "",
            block_chars=self.prefix.block_chars,
            max_blocks=self.prefix.max_blocks,
            max_body_bytes=self.request.max_body_bytes,
            conversations=self.request.conversations,
            api_keys=self.tenants.api_keys,
            classes=self.classes,
            tenant_objectives={
                name: p.objectives
                for name, p in self.tenants.definitions.items()
                if p.objectives is not None and not p.objectives.empty
            },
        )

    @property
    def routing_headers(self) -> tuple[str, ...]:
        """Headers a client must never set itself (the prefill replica's among them: a client naming
        one would have the decode replica's sidecar send its prompt anywhere)."""
        return (
            self.headers.target_cluster,
            self.headers.destination_endpoint,
            self.upstream.stream_header,
            PREFILLER_HEADER,
        )

    @property
    def identity_headers(self) -> tuple[str, ...]:
        """Headers that say who a request is (the tenant's): a rendered Envoy config strips a
        client's before any filter, so only the gateway's own authentication can set them."""
        return (self.tenants.header,)
