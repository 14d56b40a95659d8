"""A progress bar on stderr: redrawn in place on a terminal, a line per tenth otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``total`` units of work; :meth:`update` with how many are done and what is running."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 28) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.monotonic()
        self._drawn = 0.0
        self._decile = -1
        self.tty = self.stream.isatty()

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        """Redraw (at most ten times a second unless ``force``)."""
        now = time.monotonic()
        frac = min(1.0, done / self.total)
        if self.tty:
            if not force and now - self._drawn < 0.1:
                return
            self._drawn = now
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            elapsed = now - self.started
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            line = (
                f"\r{self.label} [{bar}] {frac:4.0%} {done}/{self.total}  {_clock(elapsed)} eta {_clock(eta)}  {note}"
            )
            self.stream.write(line[:160].ljust(120))
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile > self._decile or force:
                self._decile = decile
                self.stream.write(f"{self.label} {frac:4.0%} {done}/{self.total} {note}\n")
                self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s"
