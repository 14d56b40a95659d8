"""``budgets:``: the token budgets of tenants, API keys and models, their windows and the weights
of each kind of token (:mod:`extproc.state.budgets` says how they are charged)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from extproc.base.validation import Section, field_error, option
from extproc.request.usage import Usage

WINDOWS: tuple[tuple[str, int], ...] = (("minute", 60), ("day", 86_400))
KEY_PREFIX = "key/"
"""Subjects of API-key budgets are ``key/NAME`` (a tenant's subject is its bare name, as before)."""
MODEL_PREFIX = "model/"
"""Subjects of model budgets are ``model/NAME``."""
_HEX = frozenset("0123456789abcdef")

SubjectKind = Literal["tenant", "key", "model"]


def _is_digest(value: str) -> bool:
    return len(value) == 64 and set(value) <= _HEX


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
    """One subject's limits (None: no limit in that window)."""

    per_minute: float | None = option(None, "weighted tokens a minute (the clock's minutes)", gt=0)
    per_day: float | None = option(None, "weighted tokens a day (UTC days)", gt=0)

    def limit(self, window: str) -> float | None:
        """The limit of ``window`` (``minute`` or ``day``)."""
        return self.per_minute if window == "minute" else self.per_day


class KeyBudget(TokenBudget):
    """One API key's limits (config ``budgets.keys.NAME``): the key is known by its digest only."""

    sha256: str | None = option(None, "hex SHA-256 of the bearer key (omit when the entry's name is the digest itself)")

    def digest(self, name: str) -> str:
        """The digest the entry matches (its ``sha256``, else its name)."""
        return self.sha256 or name


class BudgetSettings(Section):
    """Config ``budgets:``: token metering and the budgets by tenant, API key and model."""

    enabled: bool = option(False, "read every response's usage: token counters, and the budgets below enforced")
    tenants: dict[str, TokenBudget] = option({}, "budgets by tenant name (tenants without one are metered only)")
    keys: dict[str, KeyBudget] = option(
        {}, "budgets by API key: a name (with sha256: the key's hex SHA-256) or the digest itself; never the key"
    )
    models: dict[str, TokenBudget] = option({}, "budgets by model, over every tenant's requests for it")
    weights: TokenWeights = option(TokenWeights(), "what each kind of token counts for")
    other_paths: Literal["meter", "refuse"] = option(
        "meter",
        "the other paths that run the model (/v1/responses, /v1/embeddings, /v1/audio/..., /pooling, /score, "
        "/rerank, ...): metered like chat, or refused with 403",
    )
    bytes_per_token: float = option(
        4.0,
        "a body the router does not parse is reserved and, without a usage report, charged its size at this many "
        "bytes a token (lower for a model whose tokenizer cuts finer: charged more)",
        gt=0,
    )
    output_tokens_per_s: float = option(
        50.0,
        "a request abandoned before its answer is charged its prompt and this many output tokens a second it "
        "ran (at most its max_tokens): an estimate of one sequence's decode speed",
        gt=0,
    )

    @model_validator(mode="after")
    def _subjects(self) -> BudgetSettings:
        for tenant in self.tenants:
            if tenant.startswith((KEY_PREFIX, MODEL_PREFIX)):
                message = f"{tenant!r}: a tenant's name may not start with {KEY_PREFIX!r} or {MODEL_PREFIX!r}"
                raise field_error(BudgetSettings, "tenants", message, tenant)
        seen: dict[str, str] = {}
        for name, entry in self.keys.items():
            digest = entry.digest(name)
            if not _is_digest(digest):
                message = (
                    f"{name!r}: give sha256 (the hex SHA-256 of the API key) or name the entry by the digest; "
                    "never the key itself"
                )
                raise field_error(BudgetSettings, "keys", message, name)
            if digest in seen:
                raise field_error(BudgetSettings, "keys", f"{name!r} and {seen[digest]!r} name one key", name)
            seen[digest] = name
        return self
