"""How long each model's answers are, learned from the output tokens the engines report.

The price (:mod:`extproc.routing.price`) charges a request's decode (the KV it will hold, the
steps it adds to a batch) by the output it is expected to produce. A request's ``max_tokens`` is a
cap, not an expectation, and chat clients often send none or one far beyond any answer; for those
the price took a fixed 256 tokens. Here every answer whose length the router saw (a timed body:
the usage the engine reported, else the events counted) updates its model's exponentially
weighted mean, which the price takes in place of that constant once ``min_samples`` answers were
seen.

An answer that stopped at its request's cap says only that its natural length was no shorter:
it is left out, so that a fleet of short caps does not teach a short mean. The model name comes
from the client, so at most ``max_models`` models are kept, the least recently answered dropped
first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

FORGET = 0.98
"""Each answer weighs this much less after the next: about the last fifty count."""


@dataclass(slots=True)
class _Mean:
    total: float = 0.0
    weight: float = 0.0
    samples: int = 0


class OutputLengths:
    """Each model's mean output tokens; :meth:`view` is what the price reads."""

    def __init__(self, *, min_samples: int = 8, max_models: int = 256) -> None:
        if min_samples < 1 or max_models < 1:
            raise ValueError("min_samples and max_models must be at least 1")
        self.min_samples = min_samples
        self.max_models = max_models
        self._models: OrderedDict[str, _Mean] = OrderedDict()
        self._view: dict[str, float] = {}

    def observe(self, model: str, output_tokens: int, cap: int | None) -> None:
        """A request for ``model`` (capped at ``cap`` output tokens, None: no cap) produced
        ``output_tokens``."""
        if output_tokens <= 0 or (cap is not None and cap > 0 and output_tokens >= cap):
            return
        mean = self._models.get(model)
        if mean is None:
            if len(self._models) >= self.max_models:
                dropped, _ = self._models.popitem(last=False)
                self._view.pop(dropped, None)
            mean = self._models[model] = _Mean()
        else:
            self._models.move_to_end(model)
        mean.total = mean.total * FORGET + output_tokens
        mean.weight = mean.weight * FORGET + 1.0
        mean.samples += 1
        if mean.samples >= self.min_samples:
            self._view[model] = mean.total / mean.weight

    def view(self) -> Mapping[str, float]:
        """The models with at least ``min_samples`` answers seen: their mean output tokens."""
        return self._view
