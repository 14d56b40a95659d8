"""Whether a request may go, and when: every admission rule of the request path, in one place.

A request meets the rules in this order, each an :class:`AdmissionRule` (a new rule is a class
here and a line in :func:`admission_rules`):

1. :class:`PathRule`: an API that costs tokens but is not one of the inference APIs, where
   ``budgets.other_paths`` refuses it (403);
2. :class:`BudgetRule`: the token budgets of its tenant, API key and model (``budgets:``): its
   estimate reserved, or 429 with ``Retry-After`` when one is spent;
3. :class:`QueueRule`: the fair queue (``queueing:``): held while every candidate is saturated,
   refused when the queue is full or the wait too long.

The tenant's concurrency quota is a filter of the decision itself (its tenants' terms), and
latency objectives are judged on the decision (:class:`ObjectiveVerdict`): a request every
candidate is predicted to miss is shed, held until one is predicted to meet them, or routed
best effort, as its class says (``queueing.classes[].on_miss``).

Rules take effects (:mod:`extproc.core.effects`): a reservation, a wait in the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.config import Config
from extproc.core.effects import Hold, Reserve, Steps
from extproc.fleet.queueing import FairQueue, Refusal, Ticket
from extproc.request.features import RequestFeatures
from extproc.request.openai_body import INFERENCE_PATHS, costs_tokens
from extproc.routing.model import Decision
from extproc.state.budgets import Admission as BudgetAdmission
from extproc.state.budgets import BudgetLedger

OBJECTIVE_MESSAGE = "no replica is predicted to meet this request's latency objectives now; retry later"
BUDGET_MESSAGES = {
    kind: f"this {whose} token budget is spent for now; retry after the window resets"
    for kind, whose in (("tenant", "tenant's"), ("key", "API key's"), ("model", "model's"))
}
"""The refusal's words, by the budget that refused (a tenant's, an API key's, a model's)."""
PATH_REFUSED = "this API is not served through this gateway (budgets.other_paths: refuse)"
SPENDING_REFUSALS = frozenset({"path_refused", "tokens_exceeded"})
"""Refusals of what the client may spend (decided with reason ``quota``), not of the fleet's state."""


@dataclass(slots=True)
class Admitted:
    """What admitting a request took, to give back if it is refused later or ends unused."""

    budget: BudgetAdmission | None = None
    """Its token budgets' reservation, when metered."""
    tickets: list[Ticket] = field(default_factory=list)
    """Its places in the queue, settled once it is routed."""
    held: bool = False
    """It passed the queue: it is decided on the load as it is once released."""


class AdmissionRule(Protocol):
    """One admission rule: None to let the request on, or the refusal that answers it."""

    def admit(self, features: RequestFeatures, headers: Mapping[str, str], admitted: Admitted) -> Steps[Refusal | None]:
        """Judge ``features`` (``admitted``: what earlier rules took, for this rule to add to)."""
        ...


@dataclass(frozen=True, slots=True)
class PathRule:
    """An API that costs tokens but is not an inference API, refused where the config says so."""

    refuse_other_paths: bool

    def admit(self, features: RequestFeatures, headers: Mapping[str, str], admitted: Admitted) -> Steps[Refusal | None]:
        if self.refuse_other_paths and costs_tokens(features.path) and features.path not in INFERENCE_PATHS:
            return Refusal(403, 0, PATH_REFUSED, "path_refused")
        return None
        yield  # a generator, though this rule takes no effect


@dataclass(frozen=True, slots=True)
class BudgetRule:
    """The token budgets: the request's estimate reserved on each that applies, or refused."""

    budgets: BudgetLedger
    prompt_charge: Callable[[RequestFeatures], int]
    wall: Callable[[], float]

    def admit(self, features: RequestFeatures, headers: Mapping[str, str], admitted: Admitted) -> Steps[Refusal | None]:
        if not costs_tokens(features.path):
            return None
        key = self.budgets.key_digest(headers)
        # A body not parsed (over max_body_bytes, not JSON, another API's) reserves by its size.
        tokens = self.prompt_charge(features)
        budget: BudgetAdmission = yield Reserve(features.tenant, tokens, self.wall(), key, features.model)
        admitted.budget = budget
        if budget.admitted:
            return None
        words = BUDGET_MESSAGES[budget.refused_by or "tenant"]
        return Refusal(429, budget.retry_after_s, words, "tokens_exceeded")


@dataclass(frozen=True, slots=True)
class QueueRule:
    """The fair queue: an inference request waits while every candidate is saturated."""

    def admit(self, features: RequestFeatures, headers: Mapping[str, str], admitted: Admitted) -> Steps[Refusal | None]:
        if features.path not in INFERENCE_PATHS:  # /v1/models is never held
            return None
        hold = Hold(features.request_class, features.tenant, features.pool, features.hints.demotion)
        held: Refusal | Ticket | None = yield hold
        if isinstance(held, Refusal):
            return held
        admitted.held = True
        if held is not None:
            admitted.tickets.append(held)
        return None


def admission_rules(
    config: Config,
    budgets: BudgetLedger | None,
    queue: FairQueue | None,
    prompt_charge: Callable[[RequestFeatures], int],
    wall: Callable[[], float],
) -> tuple[AdmissionRule, ...]:
    """The rules the config turns on, in the order a request meets them."""
    rules: list[AdmissionRule] = []
    if budgets is not None:
        rules.append(PathRule(config.budgets.other_paths == "refuse"))
        rules.append(BudgetRule(budgets, prompt_charge, wall))
    if queue is not None:
        rules.append(QueueRule())
    return tuple(rules)


def admit(
    rules: Sequence[AdmissionRule], features: RequestFeatures, headers: Mapping[str, str], admitted: Admitted
) -> Steps[Refusal | None]:
    """Every rule in turn, up to the first that refuses."""
    for rule in rules:
        refusal = yield from rule.admit(features, headers, admitted)
        if refusal is not None:
            return refusal
    return None


@dataclass(frozen=True, slots=True)
class ObjectiveVerdict:
    """A decision judged against the request's latency objectives, as its class says."""

    config: Config

    def misses(self, features: RequestFeatures, decision: Decision) -> bool:
        """Whether the request is predicted to miss its objectives everywhere, as its class judges
        it: short of the class's ``admit_margin`` where it sheds or queues."""
        if decision.objective_missed:
            return True
        headroom = decision.objective_headroom
        if headroom is None:
            return False
        terms = self.config.queueing.for_class(features.request_class)
        return terms.on_miss != "best_effort" and headroom < terms.admit_margin

    def on_miss(self, features: RequestFeatures) -> str:
        """``shed``, ``queue`` or ``best_effort``: what the request's class does on a predicted miss."""
        return self.config.queueing.for_class(features.request_class).on_miss

    def shed(self, features: RequestFeatures) -> Refusal:
        """The refusal that sheds a request predicted to miss."""
        terms = self.config.queueing.for_class(features.request_class)
        return Refusal(429, terms.retry_after_s, OBJECTIVE_MESSAGE, "objective")
