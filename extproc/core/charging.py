"""What a request is charged: the usage its response reported, else an estimate, once."""

from __future__ import annotations

from collections.abc import Callable

from extproc.config import Config
from extproc.core.bookkeeping import Routed
from extproc.request.features import RequestFeatures
from extproc.request.usage import Usage
from extproc.state.budgets import BudgetLedger
from extproc.state.metering import TokenMeter


class Charges:
    """Meters each request's usage (tenant, model, replica) and settles its token budgets."""

    def __init__(
        self,
        config: Config,
        clock: Callable[[], float],
        wall: Callable[[], float],
        budgets: BudgetLedger | None = None,
        meter: TokenMeter | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall
        self.budgets = budgets
        self.meter = meter

    async def charge_usage(self, routed: Routed, usage: Usage) -> None:
        """A response's reported ``usage``: metered (tenant, model, replica) and charged to the
        request's budgets, once."""
        if routed.trace is not None:
            routed.trace.usage(usage)
        self._meter(routed, usage)
        if self.budgets is not None and routed.budget is not None:
            admission, routed.budget = routed.budget, None
            await self.budgets.settle(admission, usage, self.wall())

    def estimated_usage(self, routed: Routed, output_seen: int | None = None, ran_s: float = 0.0) -> Usage:
        """What a request used that its response did not report: its prompt (the tokens known,
        else the estimate, else its body's size) and the output seen (a stream's events), or,
        for an answer never seen, an estimate from the time it ran (``budgets.output_tokens_per_s``,
        at most its ``max_tokens``)."""
        features = routed.features
        output = output_seen
        if output is None:
            output = int(max(0.0, ran_s) * self.config.budgets.output_tokens_per_s)
            if features.max_output_tokens is not None:
                output = min(output, features.max_output_tokens)
        return Usage(self.prompt_charge(features), None, output, estimated=True)

    def prompt_charge(self, features: RequestFeatures) -> int:
        """The prompt tokens a request is reserved and, unreported, charged."""
        return features.charged_prompt_tokens(self.config.budgets.bytes_per_token)

    def charge_unreported(self, routed: Routed, events: int | None) -> None:
        """A request sent upstream ended without the usage it used being charged (a stream the
        client abandoned or that was reset; ``events``: what of its body was seen, None when no
        body was read): charged an estimate now, once. An answer with an error status, and a
        stream that never answered, cost no engine step worth charging. A non-streamed answer
        cut mid-body (its usage is at its end) ran to its end on the engine before its headers
        left: charged the output estimated from the time it ran, as one never seen."""
        if routed.budget is None:  # charged already, or not metered
            return
        if events is None:
            if routed.status != 0 or routed.features.stream:
                return
            usage = self.estimated_usage(routed, ran_s=self.clock() - routed.decided_at)
        elif events == 0 and not routed.features.stream:
            usage = self.estimated_usage(routed, ran_s=self.clock() - routed.decided_at)
        else:
            usage = self.estimated_usage(routed, events)
        if routed.trace is not None:
            routed.trace.usage(usage)
        self._meter(routed, usage)
        if self.budgets is not None:
            admission, routed.budget = routed.budget, None
            self.budgets.settle_soon(admission, usage, self.wall())

    def _meter(self, routed: Routed, usage: Usage) -> None:
        if self.meter is not None:
            replica = routed.decision.replica
            self.meter.charge(routed.features.tenant, routed.features.model, replica.name if replica else "", usage)

    def release_budget(self, routed: Routed) -> None:
        """The request ended without usage to charge: its budgets' reservation goes back."""
        if self.budgets is not None and routed.budget is not None:
            self.budgets.release(routed.budget)
            routed.budget = None
