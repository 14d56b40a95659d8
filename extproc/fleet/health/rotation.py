"""Whether a replica is in rotation: a small state machine with hysteresis.

    IN  --(score < eject_below for eject_after evaluations in a row, or a hard failure)--> OUT
    OUT --(cooldown_s passed, then score > readmit_above for readmit_after in a row)----> IN

The readmit threshold sits above the eject threshold and a cooldown follows every ejection, so a
replica whose signal oscillates around one threshold does not flap, and one slow request or one
bad scrape does not eject anyone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pydantic import model_validator

from extproc.base.validation import Section, field_error, option


class RotationPolicy(Section):
    """Thresholds of the state machine (the rotation keys of config ``health:``)."""

    eject_below: float = option(0.5, "a health score below this counts toward ejection", ge=0, le=1)
    eject_after: int = option(3, "scores below eject_below in a row before ejection", ge=1)
    readmit_above: float = option(0.7, "a score above this counts toward readmission", ge=0, le=1)
    readmit_after: int = option(2, "scores above readmit_above in a row to readmit", ge=1)
    cooldown_s: float = option(10.0, "an ejected replica stays out at least this long", ge=0)

    @model_validator(mode="after")
    def _hysteresis(self) -> RotationPolicy:
        if self.readmit_above < self.eject_below:
            raise field_error(
                type(self), "readmit_above", "must not be below eject_below (hysteresis)", self.readmit_above
            )
        return self


@dataclass(frozen=True, slots=True)
class Rotation:
    """One replica's rotation state."""

    in_rotation: bool = True
    streak: int = 0
    changed_at: float = float("-inf")
    ejections: int = 0


def step(state: Rotation, score: float, now: float, policy: RotationPolicy, hard_failure: bool = False) -> Rotation:
    """The state after one evaluation with ``score`` at ``now``.

    ``hard_failure`` (connection refused, or several upstream failures in a row seen by Envoy)
    ejects at once: there is no point waiting to confirm that nothing listens.
    """
    if state.in_rotation:
        if hard_failure:
            return Rotation(False, 0, now, state.ejections + 1)
        streak = state.streak + 1 if score < policy.eject_below else 0
        if streak >= policy.eject_after:
            return Rotation(False, 0, now, state.ejections + 1)
        return replace(state, streak=streak)
    if hard_failure or now - state.changed_at < policy.cooldown_s:
        return replace(state, streak=0)
    streak = state.streak + 1 if score > policy.readmit_above else 0
    if streak >= policy.readmit_after:
        return Rotation(True, 0, now, state.ejections)
    return replace(state, streak=streak)
