"""Tenants: quotas on concurrent requests and on a share of the pool, counted at the gateway.

A tenant over its quota is refused with 429 and ``Retry-After``, or sent to a shared overflow
pool, as its policy says; other tenants are unaffected either way. Counts change at decision time
and at the end of each request, like the replicas' in-flight counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import field_validator, model_validator

from extproc.base.validation import Section, field_error, option
from extproc.request.objectives import Objectives
from extproc.request.tenant import TENANT_HEADER
from extproc.routing.model import NO_TERMS, TenantTerms

OverQuota = Literal["reject", "overflow"]
_HEX = frozenset("0123456789abcdef")


class TenantPolicy(Section):
    """One tenant's limits (config ``tenants.definitions.NAME``)."""

    max_concurrent: int | None = option(None, "requests in flight at most", ge=1)
    max_share: float | None = option(None, "share of the fleet's capacity at most", gt=0, le=1)
    shard_size: int = option(0, "replicas of its shard (0: the whole fleet)", ge=0)
    over_quota: OverQuota = option("reject", "429 + Retry-After, or the overflow pool")
    retry_after_s: int = option(1, "the Retry-After of a rejection", ge=1)
    objectives: Objectives | None = option(
        None, "latency objectives (ttft_ms, tpot_ms) of its requests that neither send nor get from their class"
    )


class TenantSettings(Section):
    """``tenants:``: who a request belongs to, and quotas.

    ``api_keys`` holds the digests of the file too: ``api_keys_file`` is read once, when the
    config is loaded.
    """

    header: str = option(TENANT_HEADER, "the header naming the tenant when no API key maps the request")
    trust_header: bool = option(
        False,
        "read header: the gateway itself sets it (its authentication: a JWT claim, an auth service); "
        "otherwise a client's is ignored",
    )
    api_keys: dict[str, str] = option({}, "hex SHA-256 digest of an API key -> tenant (never the keys)")
    api_keys_file: str | None = option(None, "a YAML/JSON file of the same mapping")
    replica_capacity: int = option(64, "requests one replica takes at once (for shares)", ge=1)
    per_replica: int = option(16, "a tenant's fair in-flight count per replica", ge=1)
    overflow_pool: dict[str, str] = option({"pool": "overflow"}, "labels of the overflow pool")
    definitions: dict[str, TenantPolicy] = option({}, "per-tenant quotas, by tenant name")

    @field_validator("header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()

    @model_validator(mode="before")
    @classmethod
    def _read_api_keys_file(cls, raw: Any) -> Any:
        if not isinstance(raw, Mapping) or not raw.get("api_keys_file"):
            return raw
        try:
            loaded = yaml.safe_load(Path(raw["api_keys_file"]).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise field_error(TenantSettings, "api_keys_file", str(exc), raw["api_keys_file"]) from None
        if not isinstance(loaded, Mapping):
            message = "expected a mapping of sha256 digest -> tenant"
            raise field_error(TenantSettings, "api_keys_file", message, raw["api_keys_file"])
        return {**raw, "api_keys": {**raw.get("api_keys", {}), **{k: str(v) for k, v in loaded.items()}}}

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, keys: dict[str, str]) -> dict[str, str]:
        for digest in keys:
            if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
                raise ValueError("keys are hex SHA-256 digests of API keys, never the keys themselves")
        return keys


class TenantLedger:
    """Requests in flight per tenant and per (tenant, replica), for tenants with a policy."""

    def __init__(self, settings: TenantSettings) -> None:
        self.settings = settings
        self.inflight: Counter[str] = Counter()
        self.by_replica: Counter[tuple[str, str]] = Counter()

    def policy(self, tenant: str) -> TenantPolicy | None:
        """The tenant's policy, if it has one."""
        return self.settings.definitions.get(tenant) if tenant else None

    def terms(self, tenant: str, replicas: int) -> TenantTerms:
        """What the decision must know of ``tenant`` now: its shard, and whether one more request
        would put it over its quota (and what happens then)."""
        policy = self.policy(tenant)
        if policy is None:
            return NO_TERMS
        return TenantTerms(
            over_quota=self.over_quota(tenant, replicas),
            over_quota_action=policy.over_quota,
            overflow_pool=tuple(sorted(self.settings.overflow_pool.items())),
            retry_after_s=policy.retry_after_s,
            shard_size=policy.shard_size,
        )

    def over_quota(self, tenant: str, replicas: int) -> bool:
        """Whether one more request would put ``tenant`` over its concurrency or share limit."""
        policy = self.policy(tenant)
        if policy is None:
            return False
        current = self.inflight[tenant]
        if policy.max_concurrent is not None and current >= policy.max_concurrent:
            return True
        if policy.max_share is not None:
            capacity = max(1, replicas) * self.settings.replica_capacity
            if current + 1 > policy.max_share * capacity:
                return True
        return False

    def begin(self, tenant: str, replica: str) -> bool:
        """Count a request; False (nothing counted) for tenants without a policy."""
        if self.policy(tenant) is None:
            return False
        self.inflight[tenant] += 1
        self.by_replica[(tenant, replica)] += 1
        return True

    def end(self, tenant: str, replica: str) -> None:
        """Uncount a request counted by :meth:`begin`."""
        self.inflight[tenant] -= 1
        if self.inflight[tenant] <= 0:
            del self.inflight[tenant]
        self.by_replica[(tenant, replica)] -= 1
        if self.by_replica[(tenant, replica)] <= 0:
            del self.by_replica[(tenant, replica)]
