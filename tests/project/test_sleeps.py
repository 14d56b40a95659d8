"""Tests wait on time only where real time is what they test against: a loop of the router's
takes its sleeper from :mod:`extproc.base.world`, so its test drives a manual world instead. A sleep
left in a test says why in a comment, on its line or the line above (a real process, a real
Redis's clock, a client's think time, a loop turn)."""

from __future__ import annotations

import re

from tests.conftest import ROOT

SLEEP = re.compile(r"\bsleep\(")
COMMENT = re.compile(r"^\s*#")


def unexplained_sleeps(text: str) -> list[int]:
    """The line numbers of sleeps in ``text`` with no comment on their line or just above."""
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        match = SLEEP.search(line)
        if match is None:
            continue
        commented = "#" in line[match.end() :] or (number > 1 and COMMENT.match(lines[number - 2]) is not None)
        if not commented:
            found.append(number)
    return found


def test_the_check_tells_a_bare_sleep_from_an_explained_one() -> None:
    call = "sl" + "eep(1)"  # spelt apart, or this very file would hold a bare one
    bare = f"async def t():\n    await asyncio.{call}\n"
    inline = f"    await asyncio.{call}  # real time: a real process\n"
    above = f"    # real time: a real process\n    time.{call}\n"
    assert unexplained_sleeps(bare) == [2]
    assert unexplained_sleeps(inline) == unexplained_sleeps(above) == []


def test_every_sleep_in_the_tests_says_why() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in (ROOT / "tests", ROOT / "lab" / "tests")
        for path in sorted(folder.rglob("*.py"))
        for n in unexplained_sleeps(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], "drive extproc.base.world's ManualWorld, or say why real time is needed"
