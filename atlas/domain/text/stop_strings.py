"""Stop strings over streamed text: cut exactly where the first stop string completes.

Text arrives in chunks that split stop strings anywhere ("<|e" + "nd|>"). The matcher keeps
back the longest tail that could still grow into a stop string, so nothing it emits has to be
taken back:

    stops = ["###", "END"]        pushed "foo ##"  -> emit "foo "  hold "##"
                                  pushed "# bar"   -> "###" completes: emit "", stop

When several stop strings complete in the same text, the one that ends first wins (it is the
one a token-by-token stream would have seen first); among those, the one that starts first.
The result is therefore the same however the text is chunked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """What one push makes safe to emit, and the stop string that ended the text, if any."""

    text: str
    stop: str | None = None  # the stop string that matched; no text follows it

    @property
    def is_stopped(self) -> bool:
        return self.stop is not None


class StopStringMatcher:
    """Applies one request's stop strings to its streamed text.

    After a match every later `push` returns empty text with the same `stop`.
    """

    __slots__ = ("_stops", "_include_stop", "_proper_prefixes", "_max_held", "_held", "_stop")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool) -> None:
        """Raises `ValueError` for an empty stop string (it would match everywhere)."""
        if any(not stop for stop in stops):
            raise ValueError("stop: stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._include_stop = include_stop_str_in_output
        # Tails worth holding: every proper prefix of a stop string ("#", "##" for "###").
        self._proper_prefixes = frozenset(stop[:size] for stop in self._stops for size in range(1, len(stop)))
        self._max_held = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self._stop: str | None = None

    def push(self, text: str) -> StopMatch:
        """Feed the next chunk; return the text safe to emit and whether a stop completed.

        On a match the text ends where the stop string starts (or where it ends, when
        `include_stop_str_in_output`); the rest of the chunk is dropped.
        """
        if self._stop is not None:
            return StopMatch("", self._stop)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stop = stop
            end = start + len(stop) if self._include_stop else start
            return StopMatch(buffer[:end], stop)
        num_held = self._num_held(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return StopMatch(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """At the end of the text: release what was held (nothing after a match)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first, ties to the earlier start."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _num_held(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of a stop string."""
        for size in range(min(self._max_held, len(buffer)), 0, -1):
            if buffer[-size:] in self._proper_prefixes:
                return size
        return 0
