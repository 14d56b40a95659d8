"""``splits:``: canary and A/B splits as the file spells them, held as
:class:`~extproc.request.splits.SplitRule`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from extproc.base.validation import Section, field_error, option
from extproc.config.held import held_as
from extproc.request.splits import SplitRule, SplitTarget


class SplitMatch(Section):
    """``splits[].match:``: every condition given must hold."""

    model: str | None = option(None, "model name glob")
    headers: dict[str, str] = option({}, "header values (exact)")
    cookies: dict[str, str] = option({}, "cookie values (exact)")
    query: dict[str, str] = option({}, "query parameter values (exact)")


class SplitTargetEntry(Section):
    """One arm of a split: the model name written into the request body."""

    model: str = Field(description="the model (or adapter) served to this arm", min_length=1)
    weight: float = option(1.0, "its share, relative to the rule's other targets", ge=0)
    pool: str | None = option(None, "confine the arm to replicas labelled pool=LABEL")


class SplitEntry(Section):
    """One item of ``splits:``, first match wins; the arm is hashed on the session (else user, else request)."""

    name: str | None = option(None, "as metrics name it (default: split-INDEX)")
    match: SplitMatch = option(SplitMatch(), "which requests it takes")
    targets: list[SplitTargetEntry] = Field(description="weighted arms", min_length=1)
    pin_header: str = option("x-canary", "a request naming a target model here is pinned to that arm", min_length=1)

    @model_validator(mode="after")
    def _targets(self) -> SplitEntry:
        if sum(t.weight for t in self.targets) <= 0:
            raise field_error(SplitEntry, "targets", "the weights must not all be zero", None)
        models = [t.model for t in self.targets]
        if len(set(models)) != len(models):
            raise field_error(SplitEntry, "targets", "each target names a different model", None)
        return self

    def rule(self) -> SplitRule:
        """The split as the request layer applies it (unnamed: named after its index by the config)."""
        m = self.match
        return SplitRule(
            name=self.name or "",
            targets=tuple(SplitTarget(t.model, t.weight, t.pool) for t in self.targets),
            model=m.model,
            headers={k.lower(): v for k, v in m.headers.items()},
            cookies=dict(m.cookies),
            query=dict(m.query),
            pin_header=self.pin_header.lower(),
        )


def _split_entry(rule: SplitRule) -> dict[str, Any]:
    match = {"model": rule.model, "headers": dict(rule.headers), "cookies": dict(rule.cookies), "query": rule.query}
    targets = [{"model": t.model, "weight": t.weight, "pool": t.pool} for t in rule.targets]
    return {"name": rule.name, "match": match, "targets": targets, "pin_header": rule.pin_header}


SplitItem = Annotated[SplitRule, held_as(SplitEntry, SplitRule, SplitEntry.rule, _split_entry)]
