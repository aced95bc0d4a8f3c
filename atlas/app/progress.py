"""Progress lines for long work (weight loading, kernel compilation, imports) on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`update(done, total)` redraws one line on a terminal, or prints every ~10% otherwise."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._started_s = time.monotonic()
        self._last_decile = -1
        self._is_tty = self.stream.isatty()

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        elapsed_s = time.monotonic() - self._started_s
        line = f"{self.label}: {done}/{total} ({100 * done // total}%) {elapsed_s:.1f}s"
        if self._is_tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
            self.stream.flush()
            return
        decile = 10 * done // total
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(line + "\n")
            self.stream.flush()
