"""The ledger: admission of a request against every budget that applies to it, the reservations
of requests in flight, and the charges of the usage responses report."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.request.tenant import api_key_digest, bearer_token
from extproc.request.usage import Usage
from extproc.state.budgets.settings import KEY_PREFIX, MODEL_PREFIX, WINDOWS, BudgetSettings, SubjectKind, TokenBudget
from extproc.state.budgets.stores import BudgetStore, MemoryBudgetStore, window_start

log = logging.getLogger("extproc.state.budgets")


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether a request may go, and what to tell the client either way."""

    admitted: bool
    limit: float | None = None
    """The deciding window's limit: the refusing one, else the tightest (None: no budget applies)."""
    remaining: float | None = None
    """What is left of it once this request's estimate is reserved."""
    reset_s: float = 0.0
    """Seconds until that window resets (the ``Retry-After`` of a refusal)."""
    reservation: float = 0.0
    """Tokens reserved for the request on each subject: handed back to :meth:`BudgetLedger.settle`."""
    subjects: tuple[str, ...] = ()
    """The budgets the request is charged to (its tenant's, its key's, its model's)."""
    refused_by: SubjectKind | None = None
    """Whose budget refused it."""

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


@dataclass(frozen=True, slots=True)
class WindowStanding:
    """One window of a budget as it stands: its limit, what is used and reserved, what is left."""

    window: str
    limit: float
    used: float
    remaining: float
    reset_s: float


@dataclass(frozen=True, slots=True)
class BudgetStanding:
    """One configured budget as it stands now (the usage export's view)."""

    kind: SubjectKind
    name: str
    windows: tuple[WindowStanding, ...]


class BudgetLedger:
    """Admission against the budgets that apply to a request, and the charges of reported usage.

    ``store`` holds the counts (shared across gateways with Redis); when it fails, ``local`` (this
    gateway's own counts, always kept) answers instead. ``reserved`` is this gateway's estimate for
    its requests in flight, per subject.
    """

    def __init__(self, settings: BudgetSettings, store: BudgetStore | None = None) -> None:
        self.settings = settings
        self.local = MemoryBudgetStore()
        self.store: BudgetStore = store or self.local
        self.reserved: dict[str, float] = {}
        self.store_failures = 0
        self._pending: set[asyncio.Task[None]] = set()  # charges on their way to the shared store
        # Subjects spelled once, at start: a request looks them up, it never builds a string.
        self._budgets: dict[str, TokenBudget] = dict(settings.tenants)
        self._kinds: dict[str, tuple[SubjectKind, str]] = {t: ("tenant", t) for t in settings.tenants}
        self._by_digest: dict[str, str] = {}
        for name, key_budget in settings.keys.items():
            subject = KEY_PREFIX + name
            self._budgets[subject], self._kinds[subject] = key_budget, ("key", name)
            self._by_digest[key_budget.digest(name)] = subject
        self._by_model: dict[str, str] = {}
        for model, model_budget in settings.models.items():
            subject = MODEL_PREFIX + model
            self._budgets[subject], self._kinds[subject] = model_budget, ("model", model)
            self._by_model[model] = subject
        self._alone = {subject: (subject,) for subject in self._budgets}

    def budget(self, tenant: str) -> TokenBudget | None:
        """The tenant's budget, if it has one."""
        return self.settings.tenants.get(tenant) if tenant else None

    def key_digest(self, headers: Mapping[str, str]) -> str | None:
        """The digest of the request's bearer key, when some key has a budget (else None: no
        key is hashed for nothing)."""
        if not self._by_digest:
            return None
        auth = headers.get("authorization")
        token = bearer_token(auth) if auth else None
        return api_key_digest(token) if token else None

    def subjects(self, tenant: str, key_digest: str | None = None, model: str = "") -> tuple[str, ...]:
        """The budgets that apply to a request of ``tenant``, with that key, for ``model``."""
        own = tenant if tenant and tenant in self.settings.tenants else None
        key = self._by_digest.get(key_digest) if key_digest else None
        of_model = self._by_model.get(model) if model and self._by_model else None
        if key is None and of_model is None:
            return self._alone[own] if own is not None else ()
        return tuple(s for s in (own, key, of_model) if s is not None)

    async def admit(
        self, tenant: str, estimated_tokens: int, now: float, *, key_digest: str | None = None, model: str = ""
    ) -> Admission:
        """Whether a request of ``tenant`` (with the key of ``key_digest``, for ``model``)
        estimated at ``estimated_tokens`` prompt tokens fits every budget that applies (its
        estimate reserved on each if so); ``now`` is the wall clock."""
        subjects = self.subjects(tenant, key_digest, model)
        if not subjects:
            return FREE
        used = await self._used(subjects, now)
        estimate = estimated_tokens * self.settings.weights.input
        tightest: tuple[float, float, float] | None = None  # (remaining, limit, reset_s)
        refused: tuple[float, float, float] | None = None
        refuser = subjects[0]
        for subject, counts in zip(subjects, used, strict=True):
            budget = self._budgets[subject]
            pending = self.reserved.get(subject, 0.0)
            for name, length in WINDOWS:
                limit = budget.limit(name)
                if limit is None:
                    continue
                remaining = limit - counts.get(name, 0.0) - pending
                reset = window_start(length, now) + length - now
                if remaining < estimate or (remaining <= 0 and estimate == 0):
                    # Of several windows out of room, the last to reset says when to retry.
                    if refused is None or reset > refused[2]:
                        refused, refuser = (remaining, limit, reset), subject
                elif tightest is None or remaining < tightest[0]:
                    tightest = (remaining, limit, reset)
        if refused is not None:
            remaining, limit, reset = refused
            return Admission(False, limit, max(0.0, remaining), reset, refused_by=self._kinds[refuser][0])
        if tightest is None:
            return FREE
        for subject in subjects:
            self.reserved[subject] = self.reserved.get(subject, 0.0) + estimate
        remaining, limit, reset = tightest
        return Admission(True, limit, remaining - estimate, reset, estimate, subjects)

    def release(self, admission: Admission) -> None:
        """A request admitted with ``admission`` ended without usage to charge (its reservation
        goes back)."""
        if not admission.reservation:
            return
        for subject in admission.subjects:
            left = self.reserved.get(subject, 0.0) - admission.reservation
            if left > 1e-9:
                self.reserved[subject] = left
            else:
                self.reserved.pop(subject, None)

    async def settle(self, admission: Admission, usage: Usage, now: float) -> None:
        """Charge ``usage`` (a response's report) to the request's budgets and hand back the
        reservation."""
        self.release(admission)
        if not admission.subjects:
            return
        tokens = self.settings.weights.total(usage)
        if tokens <= 0:
            return
        self.local.add(admission.subjects, tokens, now)
        if self.store is not self.local:
            await self._shared_charge(admission.subjects, tokens, now)

    def settle_soon(self, admission: Admission, usage: Usage, now: float) -> None:
        """:meth:`settle` from code that cannot wait (a stream's end): this gateway's own counts
        at once, the shared store's in a task of the running loop."""
        self.release(admission)
        tokens = self.settings.weights.total(usage)
        if not admission.subjects or tokens <= 0:
            return
        self.local.add(admission.subjects, tokens, now)
        if self.store is self.local:
            return
        try:
            task = asyncio.get_running_loop().create_task(self._shared_charge(admission.subjects, tokens, now))
        except RuntimeError:  # no loop: this gateway's own counts hold it
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _shared_charge(self, subjects: Sequence[str], tokens: float, now: float) -> None:
        try:
            await self.store.charge(subjects, tokens, now)
        except Exception as exc:  # shared counts unreachable: this gateway's own still limit
            self._failed("charge", exc)

    async def standings(self, now: float) -> list[BudgetStanding]:
        """Every configured budget as it stands (one store read for all of them)."""
        subjects = list(self._budgets)
        if not subjects:
            return []
        used = await self._used(subjects, now)
        out = []
        for subject, counts in zip(subjects, used, strict=True):
            budget, pending = self._budgets[subject], self.reserved.get(subject, 0.0)
            windows = []
            for name, length in WINDOWS:
                limit = budget.limit(name)
                if limit is None:
                    continue
                spent = counts.get(name, 0.0)
                reset = window_start(length, now) + length - now
                windows.append(WindowStanding(name, limit, spent, max(0.0, limit - spent - pending), reset))
            kind, name = self._kinds[subject]
            out.append(BudgetStanding(kind, name, tuple(windows)))
        return out

    async def _used(self, subjects: Sequence[str], now: float) -> list[dict[str, float]]:
        if self.store is not self.local:
            try:
                return await self.store.used(subjects, now)
            except Exception as exc:
                self._failed("read", exc)
        return await self.local.used(subjects, now)

    def _failed(self, what: str, exc: Exception) -> None:
        self.store_failures += 1
        log.debug("budget store %s failed (%s): this gateway's own counts answer", what, exc)
