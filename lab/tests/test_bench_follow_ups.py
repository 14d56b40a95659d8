"""The follow-ups' account of a run: which found their history where they went, and what the
engine prefilled for others while they waited."""

from __future__ import annotations

from extproc_lab.bench.follow_ups import follow_ups, records, summary
from extproc_lab.bench.realstack import Turn


def answer(session: str, turn: int, replica: str, times: tuple[float, float, float], prompt: int, cached: int) -> Turn:
    sent, first, done = times
    return Turn(session, turn, True, first - sent, replica, prompt, cached, sent_at=sent, first_at=first, done_at=done)


def test_each_follow_up_found_its_history_or_none_of_it_and_what_came_between() -> None:
    answers = [
        # "a" finds its whole first prompt on its second turn: nothing else went to r0 between.
        answer("a", 0, "r0", (0.0, 0.2, 0.3), 1000, 288),
        answer("a", 1, "r0", (0.3, 0.35, 0.4), 1150, 1000),
        # "b" found the shared 288 tokens first, and only those after "c" (1,212 tokens uncached)
        # and "d" (500 uncached of 600) were sent to r0 between its answers.
        answer("b", 0, "r0", (0.0, 0.3, 0.5), 1000, 288),
        answer("c", 0, "r0", (0.6, 0.9, 1.0), 1500, 288),
        answer("d", 0, "r0", (0.7, 1.0, 1.1), 600, 100),
        answer("b", 1, "r0", (0.5, 1.5, 1.6), 1150, 288),
        # Part of it; a turn answered elsewhere (a move) is no follow-up found or lost there.
        answer("c", 1, "r0", (1.6, 1.7, 1.8), 1650, 800),
        answer("d", 1, "r1", (1.1, 1.3, 1.4), 700, 0),
    ]
    got = follow_ups(answers)
    assert got["history"] == {"found": 1, "part": 1, "none": 1}
    assert got["wait_s"] == {"found": 0.05, "none": 1.0}
    # "b" waited behind c's and d's prefill; "a" behind none.
    assert got["others_prefill_tokens"] == {"found": 0.0, "none": 1712.0}
    assert records(answers)[0] == ["a", 0, "r0", 0.0, 0.2, 0.3, 1000, 288]
    assert summary("extproc", {"follow_ups": got}) == (
        "extproc: follow-ups that found their history 1, part of it 1, none 1; found: waited 0.05 s behind "
        "0 tokens of others' prefill; none: waited 1.00 s behind 1,712 tokens of others' prefill"
    )


def test_a_run_without_follow_ups_says_so() -> None:
    got = follow_ups([answer("a", 0, "r0", (0.0, 0.1, 0.2), 100, 0)])
    assert summary("extproc", {"follow_ups": got}) is None
    assert summary("smg", {"error": "did not start"}) is None
    assert got == {
        "history": {"found": 0, "part": 0, "none": 0},
        "wait_s": {"found": None, "none": None},
        "others_prefill_tokens": {"found": None, "none": None},
    }
