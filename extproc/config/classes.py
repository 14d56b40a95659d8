"""``classes:``: request classes as the file spells them, held as
:class:`~extproc.request.classes.ClassRule`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from extproc.base.validation import Section, option
from extproc.config.held import held_as
from extproc.request.classes import ClassRule
from extproc.request.objectives import Objectives


class ClassMatch(Section):
    """``classes[].match:``: every condition given must hold."""

    min_tokens: int | None = option(None, "estimated prompt tokens at least")
    max_tokens: int | None = option(None, "estimated prompt tokens at most")
    stream: bool | None = option(None, "streamed or not")
    media: bool | None = option(None, "images or audio in the messages")
    headers: dict[str, str] = option({}, "header values (exact)")
    models: str | list[str] = option([], "model name globs")


class ClassEntry(Section):
    """One item of ``classes:``, first match wins."""

    name: str = Field(description="the class, as metrics and logs name it")
    match: ClassMatch = option(ClassMatch(), "which requests belong to it")
    pool: dict[str, str] = option({}, "replica labels its requests are confined to")
    profile: str | None = option(None, "a profile under profiles: (else the default)")
    objectives: Objectives | None = option(
        None, "latency objectives (ttft_ms, tpot_ms) of its requests; their own x-slo-* may only be stricter"
    )

    def rule(self) -> ClassRule:
        """The class as the request layer matches it."""
        m = self.match
        return ClassRule(
            name=self.name,
            min_tokens=m.min_tokens,
            max_tokens=m.max_tokens,
            stream=m.stream,
            media=m.media,
            headers={k.lower(): v for k, v in m.headers.items()},
            models=tuple(m.models if isinstance(m.models, list) else [m.models]),
            pool=dict(self.pool),
            profile=self.profile,
            objectives=self.objectives,
        )


def _class_entry(rule: ClassRule) -> dict[str, Any]:
    match: dict[str, Any] = {
        "min_tokens": rule.min_tokens,
        "max_tokens": rule.max_tokens,
        "stream": rule.stream,
        "media": rule.media,
    }
    match = {k: v for k, v in match.items() if v is not None} | {"headers": dict(rule.headers)}
    match["models"] = list(rule.models)
    objectives = rule.objectives.model_dump() if rule.objectives is not None else None
    return {
        "name": rule.name,
        "match": match,
        "pool": dict(rule.pool),
        "profile": rule.profile,
        "objectives": objectives,
    }


ClassItem = Annotated[ClassRule, held_as(ClassEntry, ClassRule, ClassEntry.rule, _class_entry)]
