"""What a follow-up found cached, against what its replica prefilled for others since its last turn.

Reads the answers an ``extproc bench realstack --engine vllm --json`` run recorded per router (each
request's conversation, turn, replica, send / first-token / end times, prompt and cached tokens, as
the engine reported them) and, for every follow-up sent to the replica of its previous turn, sums
the uncached prompt tokens of the other conversations' requests whose first token came on that
replica between its previous turn's end and its own first token: the new blocks written into that
cache while its history waited there. Follow-ups are binned by that sum; each bin's hit ratio is
its cached tokens over its prompt tokens.

    .venv/bin/python benchmarks/churn_between_turns.py benchmarks/realstack/vllm-36-live18-all-followups-2.json

Results and their reading are in ``benchmarks/realstack-vllm.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BINS = (0, 1500, 3000, 5000)
"""Lower edges of the bins, in tokens (the last is open)."""

SESSION, TURN, REPLICA, SENT, FIRST, DONE, PROMPT, CACHED = range(8)


def rows(answers: list[list[Any]]) -> tuple[list[tuple[int, int, int]], int]:
    """(tokens prefilled beside it, prompt, cached) for each follow-up that stayed on its replica,
    and the number of follow-ups that moved."""
    turns: dict[str, dict[int, list[Any]]] = defaultdict(dict)
    for a in answers:
        turns[a[SESSION]][a[TURN]] = a
    stayed: list[tuple[int, int, int]] = []
    moved = 0
    for session, by_turn in turns.items():
        for turn, a in by_turn.items():
            before = by_turn.get(turn - 1)
            if before is None:
                continue
            if before[REPLICA] != a[REPLICA]:
                moved += 1
                continue
            beside = sum(
                b[PROMPT] - b[CACHED]
                for b in answers
                if b[REPLICA] == a[REPLICA] and b[SESSION] != session and before[DONE] < b[FIRST] <= a[FIRST]
            )
            stayed.append((beside, a[PROMPT], a[CACHED]))
    return stayed, moved


def report(path: Path) -> list[str]:
    """One line per router of the run at ``path``."""
    run = json.loads(path.read_text())
    lines = []
    for name, result in run["routers"].items():
        answers = result.get("answers")
        if not answers:
            continue
        stayed, moved = rows(answers)
        cells = []
        for i, lo in enumerate(BINS):
            hi = BINS[i + 1] if i + 1 < len(BINS) else None
            b = [r for r in stayed if r[0] >= lo and (hi is None or r[0] < hi)]
            label = f"{lo}-{hi}" if hi is not None else f"{lo}+"
            ratio = sum(r[2] for r in b) / sum(r[1] for r in b) if b else 0.0
            cells.append(f"{label}: {len(b)} at {ratio:.0%}")
        lines.append(f"{path.name} {name}: {len(stayed)} stayed, {moved} moved; " + "; ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="realstack --json files with answers")
    args = parser.parse_args(argv)
    for path in args.runs:
        print("\n".join(report(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
