"""The generations being answered now, and how a shutdown drains them.

At SIGINT/SIGTERM `atlas serve` stops admitting requests (they get 503) and calls `drain`:
generations in flight may finish until the shutdown timeout; each one still running then is
interrupted, so its stream sends a final chunk with finish_reason "abort" and `[DONE]` (a
non-streamed request answers with what it has, finish_reason "abort").
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio

POLL_S = 0.02
ABORT_GRACE_S = 1.0  # for interrupted generations to send their last chunk


class Interruptible(Protocol):
    def interrupt(self) -> None:
        """End now: every unfinished choice finishes with finish_reason "abort"."""
        ...


class InFlight:
    """The set of generations whose `batches()` is running."""

    def __init__(self) -> None:
        self._generations: set[Interruptible] = set()
        self._ending = False  # past the shutdown timeout: a late arrival ends at once

    def __len__(self) -> int:
        return len(self._generations)

    def add(self, generation: Interruptible) -> None:
        self._generations.add(generation)
        if self._ending:  # admitted just before the shutdown began, started after its timeout
            generation.interrupt()

    def discard(self, generation: Interruptible) -> None:
        self._generations.discard(generation)

    async def drain(self, timeout_s: float, abort_now: anyio.Event | None = None) -> int:
        """Wait until every generation has finished, at most `timeout_s` (or until `abort_now`
        is set); then interrupt those left and wait up to ABORT_GRACE_S for them to end.
        Returns how many were interrupted."""
        deadline_s = time.monotonic() + timeout_s
        while self._generations and time.monotonic() < deadline_s and not (abort_now and abort_now.is_set()):
            await anyio.sleep(POLL_S)
        self._ending = True
        left = list(self._generations)
        for generation in left:
            generation.interrupt()
        with anyio.move_on_after(ABORT_GRACE_S):
            while self._generations:
                await anyio.sleep(POLL_S)
        return len(left)
