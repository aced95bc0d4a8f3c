"""Stop strings over streamed text: cut exactly where the first stop string completes.

Text arrives in chunks that split stop strings anywhere ("<|e" + "nd|>"). The matcher keeps
back the longest tail that could still grow into a stop string, so nothing it emits has to be
taken back:

    stops = ["###", "END"]        pushed "foo ##"  -> emit "foo "  hold "##"
                                  pushed "# bar"   -> "###" completes: emit "", stop

When several stop strings complete in the same text, the one that ends first wins (it is the
one a token-by-token stream would have seen first); among those, the one that starts first.
The result is therefore the same however the text is chunked.

Matching is one Knuth-Morris-Pratt automaton per stop string, advanced a character at a time:
its state is the length of the longest tail of the text that is a prefix of that stop string,
so the held tail is the largest state. Time is linear in the text times the number of stop
strings, memory linear in the stop strings' length (one int per character, shared by every
choice of a request), whatever the strings are: nothing enumerates their prefixes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class StopMatch:
    """What one push makes safe to emit, and the stop string that ended the text, if any."""

    text: str
    stop: str | None = None  # the stop string that matched; no text follows it

    @property
    def is_stopped(self) -> bool:
        return self.stop is not None


class CompiledStops:
    """A request's stop strings with their failure tables; immutable, shared by its choices."""

    __slots__ = ("stops", "failures", "first_chars")

    def __init__(self, stops: Sequence[str]) -> None:
        """Raises `ValueError` for an empty stop string (it would match everywhere)."""
        if any(not stop for stop in stops):
            raise ValueError("stop: stop strings must not be empty")
        self.stops = tuple(dict.fromkeys(stops))
        self.failures = tuple(_failure_table(stop) for stop in self.stops)
        self.first_chars = frozenset(stop[0] for stop in self.stops)


@lru_cache(maxsize=64)
def compile_stops(stops: tuple[str, ...]) -> CompiledStops:
    """`CompiledStops` for `stops`, built once for the n choices (and repeats) of a request."""
    return CompiledStops(stops)


def _failure_table(stop: str) -> array:
    """failure[i]: length of the longest proper prefix of stop[: i + 1] that is also its suffix.

        stop     a  a  b  a  a  a
        failure  0  1  0  1  2  2
    """
    failure = array("I", bytes(4 * len(stop)))
    matched = 0
    for index in range(1, len(stop)):
        char = stop[index]
        while matched and stop[matched] != char:
            matched = failure[matched - 1]
        if stop[matched] == char:
            matched += 1
        failure[index] = matched
    return failure


class StopStringMatcher:
    """Applies one request's stop strings to its streamed text.

    After a match every later `push` returns empty text with the same `stop`.
    """

    __slots__ = ("_compiled", "_include_stop", "_states", "_held", "_stop")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool) -> None:
        """Raises `ValueError` for an empty stop string (it would match everywhere)."""
        self._compiled = compile_stops(tuple(stops))
        self._include_stop = include_stop_str_in_output
        self._states = [0] * len(self._compiled.stops)  # per stop: matched prefix length
        self._held = ""
        self._stop: str | None = None

    def push(self, text: str) -> StopMatch:
        """Feed the next chunk; return the text safe to emit and whether a stop completed.

        On a match the text ends where the stop string starts (or where it ends, when
        `include_stop_str_in_output`); the rest of the chunk is dropped.
        """
        if self._stop is not None:
            return StopMatch("", self._stop)
        if not self._held and self._compiled.first_chars.isdisjoint(text):
            return StopMatch(text)  # no stop can start in it: every state stays 0
        buffer = self._held + text
        match = self._advance(text)
        if match is not None:
            end_in_text, stop = match
            self._held = ""
            self._stop = stop
            end = len(buffer) - len(text) + end_in_text
            return StopMatch(buffer[: end if self._include_stop else end - len(stop)], stop)
        num_held = max(self._states, default=0)
        self._held = buffer[len(buffer) - num_held :]
        return StopMatch(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """At the end of the text: release what was held (nothing after a match)."""
        held, self._held = self._held, ""
        self._states = [0] * len(self._states)
        return held

    def _advance(self, text: str) -> tuple[int, str] | None:
        """Run every automaton over `text`; (end in `text`, stop) of the first completed stop.

        At one end position the longer stop (the one starting first) wins. While every state
        is 0, it jumps (with `str.find`) to the next character that can start a stop.
        """
        compiled, states = self._compiled, self._states
        stops, failures = compiled.stops, compiled.failures
        index, size = 0, len(text)
        while index < size:
            if not any(states):
                index = _next_start(text, index, compiled.first_chars)
                if index == size:
                    return None
            char = text[index]
            index += 1
            completed: str | None = None
            for k, stop in enumerate(stops):
                state = states[k]
                while state and stop[state] != char:
                    state = failures[k][state - 1]
                if stop[state] == char:
                    state += 1
                    if state == len(stop):
                        if completed is None or len(stop) > len(completed):
                            completed = stop
                        state = failures[k][state - 1]
                states[k] = state
            if completed is not None:
                return index, completed
        return None


def _next_start(text: str, start: int, first_chars: frozenset[str]) -> int:
    """The first index >= start holding a character some stop begins with (len(text) if none)."""
    found = [position for position in (text.find(char, start) for char in first_chars) if position >= 0]
    return min(found, default=len(text))
