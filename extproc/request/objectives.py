"""Default latency objectives: what a request of a class, or of a tenant, is held to when its
client sends no ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` of its own.

Each objective is filled on its own, the first that gives it winning: the request's header, then
its class's default (``classes[].objectives``), then its tenant's (``tenants.definitions.NAME.
objectives``). The class comes before the tenant because it says what kind of work the request
is (a batch job of a tenant whose chat has a 300 ms TTFT is still a batch job).
"""

from __future__ import annotations

from extproc.validation import Section, option


class Objectives(Section):
    """Default objectives, in milliseconds (either may be left out)."""

    ttft_ms: float | None = option(None, "time to first token", gt=0)
    tpot_ms: float | None = option(None, "time per output token after the first", gt=0)

    @property
    def empty(self) -> bool:
        """Neither objective is given."""
        return self.ttft_ms is None and self.tpot_ms is None


def fill(
    ttft_ms: float | None, tpot_ms: float | None, *defaults: Objectives | None
) -> tuple[float | None, float | None]:
    """``(ttft_ms, tpot_ms)`` with what is missing taken from ``defaults``, the first that gives it."""
    for d in defaults:
        if d is None:
            continue
        if ttft_ms is None:
            ttft_ms = d.ttft_ms
        if tpot_ms is None:
            tpot_ms = d.tpot_ms
    return ttft_ms, tpot_ms
