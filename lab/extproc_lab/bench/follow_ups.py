"""Whether each follow-up turn found its conversation's history in the engine's cache, and why not.

The engines' hit ratio says how much was found, not what lost the rest. A follow-up answered by
the replica that answered its previous turn finds that history there (the engine's
``cached_tokens`` cover the previous prompt), part of it, or none of it beyond what the
conversation's first turn found (the prefix it shares with others, such as a system prompt):
between the two answers the engine admitted other requests whose prefill reused the history's
freed blocks. vLLM matches a request's prefix when it schedules it, not when it arrives, so what
counts is the prefill of others that the engine took on between the previous turn's last byte and
this turn's first token.

Measured on vLLM's CPU engines at 36 conversations / 18 live (about 2.2x the fleet's KV live at
once), 24 runs of our two profiles: 5-26 of about 105 follow-ups per run found their history and
61-88 none of it; those had waited behind 4,600-7,200 tokens of others' prefill on their engine
(more than its 4,096 tokens of KV), those that found it behind 330-1,900
(benchmarks/price.md, ninth session).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Protocol

FOUND_SHARE = 0.9
"""A follow-up found its history when the engine had cached this share of the previous prompt."""


class Answer(Protocol):
    """One answered request as the client timed it (seconds into the run)."""

    session: str
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    sent_at: float
    first_at: float
    done_at: float


def follow_ups(answers: Sequence[Answer]) -> dict[str, Any]:
    """The follow-ups answered where their previous turn was: how many found their history, found
    part of it, or found none of it; for those that found it and those that found none, the mean
    wait from the previous turn's last byte to this one's first token and the mean of others'
    uncached prompt tokens sent to that replica in that time."""
    by_turn = {(a.session, a.turn): a for a in answers}
    waits: dict[str, list[float]] = {"found": [], "none": []}
    others: dict[str, list[int]] = {"found": [], "none": []}
    counts = {"found": 0, "part": 0, "none": 0}
    for a in answers:
        prev = by_turn.get((a.session, a.turn - 1))
        if prev is None or prev.replica != a.replica or not prev.prompt_tokens:
            continue
        first = by_turn.get((a.session, 0))
        shared = first.cached_tokens if first is not None else 0
        if a.cached_tokens >= FOUND_SHARE * prev.prompt_tokens:
            kind = "found"
        elif a.cached_tokens <= shared:
            kind = "none"
        else:
            kind = "part"
        counts[kind] += 1
        if kind == "part":
            continue
        waits[kind].append(a.first_at - prev.done_at)
        others[kind].append(
            sum(
                o.prompt_tokens - o.cached_tokens
                for o in answers
                if o.replica == a.replica and o.session != a.session and prev.done_at <= o.sent_at <= a.first_at
            )
        )
    return {
        "history": counts,
        "wait_s": {k: _mean(v) for k, v in waits.items()},
        "others_prefill_tokens": {k: _mean(v) for k, v in others.items()},
    }


def summary(router: str, figures: dict[str, Any]) -> str | None:
    """One line of what :func:`follow_ups` found for ``router`` (None without follow-ups)."""
    fu = figures.get("follow_ups")
    if not fu or not sum(fu["history"].values()):
        return None
    h, wait, others = fu["history"], fu["wait_s"], fu["others_prefill_tokens"]
    line = f"{router}: follow-ups that found their history {h['found']}, part of it {h['part']}, none {h['none']}"
    for kind in ("found", "none"):
        if wait[kind] is not None:
            line += f"; {kind}: waited {wait[kind]:.2f} s behind {others[kind]:,.0f} tokens of others' prefill"
    return line


def records(answers: Sequence[Answer]) -> list[list[Any]]:
    """Each answer as ``[session, turn, replica, sent_at, first_at, done_at, prompt_tokens,
    cached_tokens]``, for an analysis this module does not make."""
    return [
        [
            a.session,
            a.turn,
            a.replica,
            round(a.sent_at, 4),
            round(a.first_at, 4),
            round(a.done_at, 4),
            a.prompt_tokens,
            a.cached_tokens,
        ]
        for a in answers
    ]


def _mean(values: list[float] | list[int]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None
