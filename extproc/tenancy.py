"""Tenants: quotas on concurrent requests and on a share of the pool, counted at the gateway.

A tenant over its quota is refused with 429 and ``Retry-After``, or sent to a shared overflow
pool, as its policy says; other tenants are unaffected either way. Counts change at decision time
and at the end of each request, like the replicas' in-flight counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from extproc.routing.model import NO_TERMS, TenantTerms

OverQuota = Literal["reject", "overflow"]


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's limits (config ``tenants.definitions.NAME``)."""

    max_concurrent: int | None = None
    max_share: float | None = None
    shard_size: int = 0
    over_quota: OverQuota = "reject"
    retry_after_s: int = 1


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """Config ``tenants:``."""

    definitions: Mapping[str, TenantPolicy] = field(default_factory=dict)
    replica_capacity: int = 64
    per_replica: int = 16
    overflow_pool: Mapping[str, str] = field(default_factory=lambda: {"pool": "overflow"})


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
