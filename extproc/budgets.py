"""Token budgets: tokens per minute and per day for a tenant, charged from the usage replicas report.

Platforms meter in tokens, not requests. A budget limits a weighted total of the tokens a tenant's
requests used (``weights``: input, cached input and output tokens each count for their weight; a
cached token is cheaper to serve than one prefilled) over fixed windows, a minute and a day, that
reset on the clock's boundaries. Each response's reported usage is charged when it is read; a
request is admitted while the tenant's window has room for its estimated prompt tokens on top of
what is charged and what its requests in flight have reserved, so a burst overshoots by at most
the requests in flight. Over budget: 429 with ``Retry-After`` (seconds to the window's end) and
OpenAI's ``x-ratelimit-*-tokens`` headers.

Where the counts live is a :class:`BudgetStore`: process memory for one gateway, Redis for several
(one atomic round trip per charge). The ledger never raises for its store: a store that fails
degrades to this gateway's own counts, never to no limit and never to refusing everyone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

from extproc.usage import Usage
from extproc.validation import Section, option

log = logging.getLogger("extproc.budgets")

WINDOWS: tuple[tuple[str, int], ...] = (("minute", 60), ("day", 86_400))


class TokenWeights(Section):
    """What each kind of token counts for in a budget."""

    input: float = option(1.0, "an input token not found cached", ge=0)
    cached_input: float = option(0.25, "an input token the replica had cached", ge=0)
    output: float = option(1.0, "an output token", ge=0)

    def total(self, usage: Usage) -> float:
        """The weighted total of ``usage`` (cached tokens are part of the input and counted once)."""
        cached = usage.cached_input or 0
        return max(0, usage.input - cached) * self.input + cached * self.cached_input + usage.output * self.output


class TokenBudget(Section):
    """One tenant's limits (None: no limit in that window)."""

    per_minute: float | None = option(None, "weighted tokens a minute (the clock's minutes)", gt=0)
    per_day: float | None = option(None, "weighted tokens a day (UTC days)", gt=0)

    def limit(self, window: str) -> float | None:
        """The limit of ``window`` (``minute`` or ``day``)."""
        return self.per_minute if window == "minute" else self.per_day


class BudgetSettings(Section):
    """Config ``budgets:``: token metering and the budgets by tenant."""

    enabled: bool = option(False, "read every response's usage: token counters, and the budgets below enforced")
    tenants: dict[str, TokenBudget] = option({}, "budgets by tenant name (tenants without one are metered only)")
    weights: TokenWeights = option(TokenWeights(), "what each kind of token counts for")


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether a request may go, and what to tell the client either way."""

    admitted: bool
    limit: float | None = None
    """The tightest window's limit (None: the tenant has no budget)."""
    remaining: float | None = None
    """What is left of it once this request's estimate is reserved."""
    reset_s: float = 0.0
    """Seconds until that window resets (the ``Retry-After`` of a refusal)."""
    reservation: float = 0.0
    """Tokens reserved for the request: handed back to :meth:`BudgetLedger.settle`."""

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the window resets (at least 1)."""
        return max(1, math.ceil(self.reset_s))

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers for tokens, and ``Retry-After`` when refused."""
        if self.limit is None:
            return {}
        out = {
            "x-ratelimit-limit-tokens": str(math.floor(self.limit)),
            "x-ratelimit-remaining-tokens": str(max(0, math.floor(self.remaining or 0.0))),
            "x-ratelimit-reset-tokens": f"{self.reset_s:.0f}s",
        }
        if not self.admitted:
            out["retry-after"] = str(self.retry_after_s)
        return out


FREE = Admission(True)


class BudgetStore(Protocol):
    """Where the charged tokens are counted, per subject and window."""

    async def charge(self, subject: str, tokens: float, now: float) -> dict[str, float]:
        """Add ``tokens`` to ``subject``'s current windows; the new totals by window name."""
        ...

    async def used(self, subject: str, now: float) -> dict[str, float]:
        """``subject``'s totals in its current windows, by window name."""
        ...


def window_start(length_s: int, now: float) -> int:
    """The start of the fixed window of ``length_s`` that holds ``now`` (wall clock seconds)."""
    return int(now // length_s) * length_s


class MemoryBudgetStore:
    """Counts in process memory: the budgets of one gateway."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], float] = {}

    async def charge(self, subject: str, tokens: float, now: float) -> dict[str, float]:
        """Add, and forget windows that are over."""
        out = {}
        for name, length in WINDOWS:
            key = (subject, name, window_start(length, now))
            out[name] = self._counts[key] = self._counts.get(key, 0.0) + tokens
        if len(self._counts) > 4 * 1024:
            self._counts = {k: v for k, v in self._counts.items() if k[2] + dict(WINDOWS)[k[1]] > now}
        return out

    async def used(self, subject: str, now: float) -> dict[str, float]:
        """The current windows' totals."""
        return {name: self._counts.get((subject, name, window_start(length, now)), 0.0) for name, length in WINDOWS}


class BudgetLedger:
    """Admission against each tenant's budget, and the charges of reported usage.

    ``store`` holds the counts (shared across gateways with Redis); when it fails, ``local`` (this
    gateway's own counts, always kept) answers instead. ``reserved`` is this gateway's estimate for
    its requests in flight, per tenant.
    """

    def __init__(self, settings: BudgetSettings, store: BudgetStore | None = None) -> None:
        self.settings = settings
        self.local = MemoryBudgetStore()
        self.store: BudgetStore = store or self.local
        self.reserved: dict[str, float] = {}
        self.store_failures = 0

    def budget(self, tenant: str) -> TokenBudget | None:
        """The tenant's budget, if it has one."""
        return self.settings.tenants.get(tenant) if tenant else None

    async def admit(self, tenant: str, estimated_tokens: int, now: float) -> Admission:
        """Whether a request of ``tenant`` estimated at ``estimated_tokens`` prompt tokens fits
        (its estimate reserved if so); ``now`` is the wall clock."""
        budget = self.budget(tenant)
        if budget is None:
            return FREE
        used = await self._used(tenant, now)
        estimate = estimated_tokens * self.settings.weights.input
        pending = self.reserved.get(tenant, 0.0)
        tightest: tuple[float, float, float] | None = None  # (remaining, limit, reset_s)
        for name, length in WINDOWS:
            limit = budget.limit(name)
            if limit is None:
                continue
            remaining = limit - used.get(name, 0.0) - pending
            reset = window_start(length, now) + length - now
            if remaining < estimate or (remaining <= 0 and estimate == 0):
                return Admission(False, limit, max(0.0, remaining), reset)
            if tightest is None or remaining < tightest[0]:
                tightest = (remaining, limit, reset)
        if tightest is None:
            return FREE
        self.reserved[tenant] = pending + estimate
        remaining, limit, reset = tightest
        return Admission(True, limit, remaining - estimate, reset, estimate)

    def release(self, tenant: str, admission: Admission) -> None:
        """A request admitted with ``admission`` ended without usage to charge (its reservation
        goes back)."""
        if admission.reservation:
            left = self.reserved.get(tenant, 0.0) - admission.reservation
            if left > 1e-9:
                self.reserved[tenant] = left
            else:
                self.reserved.pop(tenant, None)

    async def settle(self, tenant: str, admission: Admission, usage: Usage, now: float) -> None:
        """Charge ``usage`` (a response's report) to ``tenant`` and hand back the reservation."""
        self.release(tenant, admission)
        if self.budget(tenant) is None:
            return
        tokens = self.settings.weights.total(usage)
        if tokens <= 0:
            return
        await self.local.charge(tenant, tokens, now)
        if self.store is not self.local:
            try:
                await self.store.charge(tenant, tokens, now)
            except Exception as exc:  # shared counts unreachable: this gateway's own still limit
                self._failed("charge", exc)

    async def _used(self, tenant: str, now: float) -> dict[str, float]:
        if self.store is not self.local:
            try:
                return await self.store.used(tenant, now)
            except Exception as exc:
                self._failed("read", exc)
        return await self.local.used(tenant, now)

    def _failed(self, what: str, exc: Exception) -> None:
        self.store_failures += 1
        log.debug("budget store %s failed (%s): this gateway's own counts answer", what, exc)
