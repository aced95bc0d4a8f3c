"""Startup phases: the one line format in which every part of a server's start reports its time.

Each phase is logged once, by whichever component does the work (the API process, the engine
process, the device backend), on the `atlas.startup` logger:

    startup: weights: 3.12 s (at 6.40 s); 14.96 GiB, 5.15 GB/s, 291 tensors
             ^name    ^seconds  ^since the start  ^detail (optional)

"At" counts from the server's start: `ATLAS_STARTUP_EPOCH` (a `time.time()` value, which the
API process sets for the engine process it spawns and `atlas bench startup` sets for the server
it starts), else from when this module was first imported in the process. `parse_phase` reads
a line back, for `atlas bench startup`'s table.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

EPOCH_ENVIRONMENT = "ATLAS_STARTUP_EPOCH"
LOGGER_NAME = "atlas.startup"

_IMPORTED_AT = time.time()
_LINE = re.compile(r"startup: (?P<name>[^:]+): (?P<seconds>[\d.]+) s \(at (?P<at>[\d.]+) s\)(?:; (?P<detail>.*))?$")
_log = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True, slots=True)
class StartupPhase:
    """One phase: its name, how long it took, when it ended (seconds since the start), what it did."""

    name: str
    seconds: float
    at_s: float
    detail: str = ""

    def line(self) -> str:
        detail = f"; {self.detail}" if self.detail else ""
        return f"startup: {self.name}: {self.seconds:.2f} s (at {self.at_s:.2f} s){detail}"


def startup_epoch() -> float:
    """The server's start as a `time.time()` value (see the module doc)."""
    configured = os.environ.get(EPOCH_ENVIRONMENT)
    try:
        return float(configured) if configured else _IMPORTED_AT
    except ValueError:
        return _IMPORTED_AT


def since_start_s() -> float:
    """Seconds from the server's start until now."""
    return max(time.time() - startup_epoch(), 0.0)


def report_phase(name: str, seconds: float, detail: str = "") -> StartupPhase:
    """Log one phase that ends now (`name` must not contain a colon) and return it."""
    if ":" in name:
        raise ValueError(f"phase name {name!r}: a colon would break the line format")
    phase = StartupPhase(name, seconds, since_start_s(), detail)
    _log.info("%s", phase.line())
    return phase


def parse_phase(line: str) -> StartupPhase | None:
    """The phase a log line reports (anything may precede `startup:`), or None."""
    match = _LINE.search(line.rstrip())
    if match is None:
        return None
    return StartupPhase(match["name"], float(match["seconds"]), float(match["at"]), match["detail"] or "")


class PhaseTimer:
    """Times consecutive phases: `lap(name, detail)` reports the time since the previous lap
    (or since construction); `detail` may be a function of those seconds (a rate)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self, name: str, detail: str | Callable[[float], str] = "") -> StartupPhase:
        now = time.perf_counter()
        seconds, self._last = max(now - self._last, 1e-9), now
        return report_phase(name, seconds, detail(seconds) if callable(detail) else detail)
