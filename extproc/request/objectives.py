"""Default latency objectives: what a request of a class, or of a tenant, is held to when its
client sends no ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` of its own.

Each objective is filled on its own: the default is the first that gives it of its class's
(``classes[].objectives``) and its tenant's (``tenants.definitions.NAME.objectives``). The class
comes before the tenant because it says what kind of work the request is (a batch job of a tenant
whose chat has a 300 ms TTFT is still a batch job). The request's own header may only tighten a
default (the stricter of the two counts): a client sending ``x-slo-ttft-ms: 60000`` in a class
that sheds at 300 ms would otherwise never be shed. Where no default gives the objective, the
header sets it; ``loosen: true`` in the defaults lets a header loosen them too.
"""

from __future__ import annotations

from extproc.base.validation import Section, option


class Objectives(Section):
    """Default objectives, in milliseconds (either may be left out)."""

    ttft_ms: float | None = option(None, "time to first token", gt=0)
    tpot_ms: float | None = option(None, "time per output token after the first", gt=0)
    loosen: bool = option(
        False, "a request's own x-slo-ttft-ms / x-slo-tpot-ms may be looser than these (else only stricter counts)"
    )

    @property
    def empty(self) -> bool:
        """Neither objective is given."""
        return self.ttft_ms is None and self.tpot_ms is None


def fill(
    ttft_ms: float | None, tpot_ms: float | None, *defaults: Objectives | None
) -> tuple[float | None, float | None]:
    """``(ttft_ms, tpot_ms)``, the request's own (None where it sent none), against ``defaults``
    (the first that gives an objective sets it): a default missing is taken, and a request's own
    counts only where it is stricter, unless the defaults that give it allow ``loosen``."""
    given = [d for d in defaults if d is not None]
    ttft = next(((d.ttft_ms, d.loosen) for d in given if d.ttft_ms is not None), None)
    tpot = next(((d.tpot_ms, d.loosen) for d in given if d.tpot_ms is not None), None)
    return _held(ttft_ms, ttft), _held(tpot_ms, tpot)


def _held(own: float | None, default: tuple[float, bool] | None) -> float | None:
    """One objective: the request's own, its default, or the stricter of the two."""
    if default is None:
        return own
    value, loosen = default
    if own is None:
        return value
    return own if loosen else min(own, value)
