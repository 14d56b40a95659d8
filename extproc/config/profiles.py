"""``profile:`` and ``profiles:``: routing profiles as the file spells them (their filters, scorers
and picker), checked here and held as the mapping :mod:`extproc.routing.registry` builds from."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from extproc.base.validation import Section, option
from extproc.config.held import held_as


class PluginSpec(Section):
    """A filter or picker of a profile: its registered ``type`` and its ``parameters``."""

    type: str = Field(description="the plugin's registered name")
    parameters: dict[str, Any] = option({}, "the plugin's own fields, checked against its types")


class ScorerSpec(PluginSpec):
    """A scorer of a profile, with its weight."""

    weight: float = option(1.0, "what its [0, 1] score is multiplied by", ge=0)


class ProfileSpec(Section):
    """A routing profile: filters, weighted scorers, one picker (missing parts: the default's)."""

    name: str | None = option(None, "as metrics name it")
    filters: list[PluginSpec] | None = option(None, "candidates removed, in order")
    scorers: list[ScorerSpec] | None = option(None, "weighted scores summed per replica")
    picker: PluginSpec | None = option(None, "chooses among the scored candidates")

    def mapping(self) -> dict[str, Any]:
        """The profile as :func:`~extproc.routing.registry.build_profile` reads it."""
        return self.model_dump(exclude_none=True)


# A profile is held as the mapping build_profile reads; the file's is checked as a ProfileSpec.
ProfileMapping = Annotated[dict[str, Any], held_as(ProfileSpec, None, ProfileSpec.mapping, lambda m: m)]
