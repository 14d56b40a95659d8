"""The index's predicted hit against the hit the replica reports in its response body.

vLLM reports a request's cached prompt tokens as ``usage.prompt_tokens_details.cached_tokens``
(with ``--enable-prompt-tokens-details``): at the end of a JSON body, and in the last chunk of a
stream whose client asked ``stream_options.include_usage``; :class:`extproc.request.usage.UsageTail` reads
it from the body's last bytes as the body passes.

A prediction agrees when it is within one block of the report: vLLM recomputes a prompt's last
token, so a fully cached, block-aligned prompt reports one block fewer than it holds.

Predictions that keep disagreeing are acted on (:class:`PredictionStreaks`): after
``kv_events.stale_after_mispredictions`` wrong checks in a row on a replica, its feed is treated
as stale (the estimate answers for it) while its would-be predictions are still checked; it is
used again after :data:`RESUME_AFTER` right ones in a row that claimed a block or more, or when
its feed resyncs. An agreement on nothing (a cold prompt, predicted and reported under one block)
proves nothing either way: it neither breaks a wrong streak nor counts towards resuming.
"""

from __future__ import annotations

from dataclasses import dataclass


def outcome(predicted: int, reported: int, block_size: int) -> str:
    """``agree`` within one block, else ``over`` (the index promised more than was cached: stale
    or lost removals) or ``under`` (the replica had more than the index knew)."""
    if abs(predicted - reported) <= block_size:
        return "agree"
    return "over" if predicted > reported else "under"


RESUME_AFTER = 2
"""Right predictions in a row (each claiming at least one block) that lift a suspension."""


@dataclass(slots=True)
class _Streak:
    wrong: int = 0
    right: int = 0


class PredictionStreaks:
    """Per replica, how many checked predictions in a row were wrong, and right."""

    __slots__ = ("_streaks", "threshold")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        """Wrong checks in a row that make a feed stale (0: never)."""
        self._streaks: dict[str, _Streak] = {}

    def record(self, replica: str, result: str, predicted: int, block_size: int, suspended: bool) -> str | None:
        """Take in one check's ``result``; returns ``"suspend"`` when the feed should be set aside
        now, ``"resume"`` when a suspended one should be used again, else None."""
        if self.threshold <= 0 or result not in ("agree", "over", "under"):
            return None
        s = self._streaks.setdefault(replica, _Streak())
        if result != "agree":
            s.wrong += 1
            s.right = 0
        elif predicted >= max(1, block_size):
            s.right += 1
            s.wrong = 0
        if not suspended and s.wrong >= self.threshold:
            s.wrong = s.right = 0  # a resync lifts it: it must then go wrong afresh to be set aside again
            return "suspend"
        if suspended and s.right >= RESUME_AFTER:
            s.wrong = s.right = 0
            return "resume"
        return None

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet."""
        self._streaks.pop(replica, None)
