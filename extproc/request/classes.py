"""Request classes: rules that sort requests (short, long-context, multimodal, batch, ...) so each
class can be bound to a pool of replicas and to its own routing profile. First match wins."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.request.objectives import Objectives


@dataclass(frozen=True, slots=True)
class ClassRule:
    """One class: what it matches, the replicas it may use (a label selector), its profile, and
    the latency objectives its requests are held to when they carry none."""

    name: str
    min_tokens: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    media: bool | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    pool: Mapping[str, str] = field(default_factory=dict)
    profile: str | None = None
    objectives: Objectives | None = None

    def matches(self, tokens: int, stream: bool, media: bool, model: str, headers: Mapping[str, str]) -> bool:
        """Whether a request with these properties belongs to this class."""
        if self.min_tokens is not None and tokens < self.min_tokens:
            return False
        if self.max_tokens is not None and tokens > self.max_tokens:
            return False
        if self.stream is not None and stream != self.stream:
            return False
        if self.media is not None and media != self.media:
            return False
        if self.models and not any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models):
            return False
        return all(headers.get(k, "").lower() == v.lower() for k, v in self.headers.items())


def classify(
    rules: tuple[ClassRule, ...], tokens: int, stream: bool, media: bool, model: str, headers: Mapping[str, str]
) -> ClassRule | None:
    """The first rule that matches, or None (the default class: the whole fleet)."""
    for rule in rules:
        if rule.matches(tokens, stream, media, model, headers):
            return rule
    return None
