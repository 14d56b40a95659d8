"""Statistics the lab reports, defined once so that every table's p99 means the same thing."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank: the smallest value with at least a
    share ``q`` of all values at or below it. 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return float(ordered[rank])
