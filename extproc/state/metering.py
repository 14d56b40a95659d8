"""Token metering: the tokens each response reported, by tenant and model, since this process
started, and the same counts handed to an observer (``extproc_tokens_total`` in ``/metrics``).

Kinds are disjoint, so they add up to what a response used: ``input`` is the prompt tokens the
replica prefilled, ``cached_input`` those it found cached (the report's ``cached_tokens``; 0 when
the replica does not report them), ``output`` the completion tokens. Each row also says how many
of its tokens the router estimated (a stream cut short, a body not parsed, an answer without a
usage report) rather than the replica reported. Labels stay bounded: a tenant
the config does not name (``tenants:``, ``budgets:``) counts as ``other`` (tenant names may come
from a client's header), and so does a model past the first :data:`MAX_MODELS` seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from extproc.request.usage import Usage

OTHER = "other"
MAX_MODELS = 32
"""Distinct models counted by name (as ``extproc.observe.metrics.MAX_MODEL_LABELS``); later ones are ``other``."""
KINDS = ("input", "cached_input", "output")


class MeterObserver(Protocol):
    """What metering reports: one response's tokens, by kind, where it went."""

    def tokens_used(self, tenant: str, model: str, replica: str, input: int, cached_input: int, output: int) -> None:
        """A response's tokens (labels already bounded)."""
        ...


class NullMeterObserver:
    """Reports nothing."""

    def tokens_used(self, tenant: str, model: str, replica: str, input: int, cached_input: int, output: int) -> None:
        """Nothing."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    """A tenant's tokens for one model since the meter started."""

    tenant: str
    model: str
    input: int
    cached_input: int
    output: int
    estimated: int = 0
    """Of the tokens above, those the router estimated (not reported by the replica)."""

    @property
    def total(self) -> int:
        """Every token, of every kind."""
        return self.input + self.cached_input + self.output


class TokenMeter:
    """Counts reported tokens by (tenant, model) and reports each response to ``observer``.

    ``tenants`` are the names the config knows; ``started_at`` is the wall clock at the start (the
    export's "since").
    """

    def __init__(
        self,
        tenants: Iterable[str],
        observer: MeterObserver | None = None,
        started_at: float = 0.0,
        max_models: int = MAX_MODELS,
    ) -> None:
        self.tenants = frozenset(tenants)
        self.observer: MeterObserver = observer or NullMeterObserver()
        self.started_at = started_at
        self.max_models = max_models
        self._models: set[str] = set()
        # Per (tenant, model): [input, cached_input, output, estimated], updated in place.
        self._counts: dict[tuple[str, str], list[int]] = {}

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` if the config names it, else ``other``."""
        return tenant if tenant in self.tenants else OTHER

    def model_label(self, model: str) -> str:
        """``model`` while fewer than ``max_models`` are known, else ``other``."""
        if model in self._models:
            return model
        if len(self._models) >= self.max_models:
            return OTHER
        self._models.add(model)
        return model

    def charge(self, tenant: str, model: str, replica: str, usage: Usage) -> None:
        """Count one response's ``usage``, reported or estimated (``replica``: where it was sent,
        "" for none)."""
        cached = min(usage.cached_input or 0, usage.input)
        fresh, output = usage.input - cached, usage.output
        if not (fresh or cached or output):
            return
        t, m = self.tenant_label(tenant), self.model_label(model)
        counts = self._counts.get((t, m))
        if counts is None:
            counts = self._counts[(t, m)] = [0, 0, 0, 0]
        counts[0] += fresh
        counts[1] += cached
        counts[2] += output
        if usage.estimated:
            counts[3] += fresh + cached + output
        self.observer.tokens_used(t, m, replica or "none", fresh, cached, output)

    def rows(self) -> list[UsageRow]:
        """Every (tenant, model) counted, by tenant then model."""
        return [UsageRow(t, m, *counts) for (t, m), counts in sorted(self._counts.items())]
