"""Superset masks that also know how many characters a counted string has left.

A JSON schema with `maxLength` strings is sampled under the masks of its twin without the
bounds (`relaxed_schema`), and a token the schema refuses costs its sequence two steps. Most
refusals are one kind: a string at or near its bound and a token too long for what is left.
This module removes those from the superset's mask without the counting lexer's cost:

- After each token, a string open in the superset is told by the quote parity of what was
  written (per-token tables; escapes followed byte by byte).
- Then one probe, `validate_tokens` of a run of single-character tokens (`a`), first on the
  superset, then on the schema. The superset accepting the whole run means the position is
  inside a string whose characters the twin does not limit, and there the schema differs from
  the twin by length bounds alone. So the first refused `a` of the schema's run ends the
  string's room: `remaining` characters, for every character, not only for `a`.
- Later tokens of printable ASCII without quote or backslash count down `remaining` exactly.
  Any other token (non-ASCII, escapes, quotes) probes again.
- The mask then drops every token that writes more than `remaining` characters before it
  could close the string (`StringTables.lower_bound`: code points before its first `"` or `\\`,
  one more for an escape, which writes a character once complete).

Soundness: a token dropped here is one the schema refuses, so the mask stays a superset and the
engine's check (`admits`) still decides. The probe certifies itself: a position outside a
string, mid-escape or mid-character, under a pattern, enum or format that refuses `a`, or inside
a string with no bound within reach gives no `remaining`, and the twin's mask is used as it is.
An `anyOf` could bound `a` differently from other characters (branches with their own patterns
and bounds), so a schema with one gets no counting (`counts_strings`).

One probe costs ~1 us (SmolLM2's vocabulary), about once per string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_NO_LIMIT = -1  # this string: no bound to apply (not counted, or the probe says nothing)
_PROBE = -2  # inside a string whose room is not known yet: probe after the next token
_MAX_PROBE = 64  # `a`s in one probe at most
_HISTORY = 1024  # tokens a rollback may take back; past that the counting stops for the sequence
_EVEN, _ODD, _ESCAPE = -1, -2, -3  # token codes other than a plain run's length


def counts_strings(schema: Any) -> int | None:
    """The longest `maxLength` of `schema` when its strings can be counted down (module doc),
    else None (no bound, or an `anyOf` somewhere)."""
    longest = -1
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, Mapping):
            if "anyOf" in node:
                return None
            bound = node.get("maxLength")
            if isinstance(bound, int) and not isinstance(bound, bool):
                longest = max(longest, bound)
            stack.extend(node.values())
    return longest if longest >= 0 else None


class StringTables:
    """Per-tokenizer facts about each token's bytes, and the masks of tokens short enough."""

    def __init__(self, decode: Any, is_special: Any, vocab_size: int, num_words: int) -> None:
        self.bytes = [b""] * vocab_size  # read byte by byte after an escape's backslash, or with one
        for token_id in range(vocab_size):
            try:
                if not is_special(token_id):  # a special token stays b"": never dropped, no quotes
                    self.bytes[token_id] = decode([token_id])
            except (ValueError, IndexError):  # an embedding row past the tokenizer's vocabulary
                pass
        self.probe_token = next((t for t, data in enumerate(self.bytes) if data == b"a"), None)
        # The per-token facts in numpy over all tokens' bytes laid end to end (a Python loop over
        # each token's bytes took ~0.2 s on 49k tokens; this ~20 ms).
        lengths = np.fromiter(map(len, self.bytes), np.int64, vocab_size)
        flat = np.frombuffer(b"".join(self.bytes), np.uint8)
        owner = np.repeat(np.arange(vocab_size), lengths)  # the token of each byte
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        position = np.arange(flat.size) - starts[owner]
        quote, backslash = flat == 0x22, flat == 0x5C
        # where each token's string part ends: its first quote or backslash, else its length
        cut = lengths.copy()
        stops = np.flatnonzero(quote | backslash)
        np.minimum.at(cut, owner[stops], position[stops])
        counted = (flat & 0xC0 != 0x80) & (position < cut[owner])  # code points before the cut
        escape_first = np.zeros(vocab_size, bool)  # an escape writes a character, once complete
        escape_first[owner[backslash & (position == cut[owner])]] = True
        self.lower_bound = np.zeros(num_words * 32, np.int32)  # code points before a '"' or '\\'
        self.lower_bound[:vocab_size] = np.bincount(owner, counted, vocab_size).astype(np.int32) + escape_first
        quotes = np.bincount(owner, quote, vocab_size).astype(np.int64)
        has_backslash = np.bincount(owner, backslash, vocab_size) > 0
        printable = np.bincount(owner, (flat >= 0x20) & (flat < 0x7F), vocab_size) == lengths
        plain = printable & (quotes == 0) & ~has_backslash & (lengths > 0)
        # Per token, for the per-token path: the length of printable ASCII without '"' or '\\'
        # (>= 0), else _EVEN or _ODD quotes, or _ESCAPE (a backslash: read byte by byte).
        codes = np.where(quotes % 2 == 1, _ODD, _EVEN)
        codes = np.where(plain, lengths, np.where(has_backslash, _ESCAPE, codes))
        self.codes = codes.tolist()
        self.longest = int(self.lower_bound.max())
        self._keep: dict[int, np.ndarray] = {}

    def keep(self, remaining: int) -> np.ndarray:
        """int32 [W]: the tokens that write at most `remaining` characters before a quote or
        backslash (ids past the vocabulary set: the twin's mask already decides them)."""
        row = self._keep.get(remaining)
        if row is None:
            bits = np.packbits(self.lower_bound <= remaining, bitorder="little")
            row = self._keep[remaining] = bits.view(np.int32).copy()
        return row


class CountedString:
    """Where one sequence stands in its current string: kept by the schema's matcher, read by
    its superset's fill. `advance` after each accepted token; `rollback` and `copy` follow the
    matchers'."""

    __slots__ = ("_tables", "_codes", "_probe_run", "_longest_bound", "_state", "_history")

    def __init__(self, tables: StringTables, longest_bound: int) -> None:
        assert tables.probe_token is not None
        self._tables = tables
        self._codes = tables.codes
        self._longest_bound = longest_bound
        self._probe_run = [tables.probe_token] * min(longest_bound + 1, _MAX_PROBE)
        self._state = (False, False, _NO_LIMIT)  # in a string, after a backslash, remaining
        self._history: list[tuple[bool, bool, int]] | None = []  # None: stopped (rolled back too far)

    def advance(self, token_id: int, exact: Any, superset: Any) -> None:
        """Follow `token_id`, accepted by both native matchers (`exact`, `superset`)."""
        history = self._history
        if history is None:
            return
        state = self._state
        history.append(state)
        if len(history) > 2 * _HISTORY:
            del history[:_HISTORY]
        code = self._codes[token_id]
        in_string, escaped, remaining = state
        if code >= 0 and in_string and not escaped:  # printable ASCII inside the string
            if remaining >= 0:
                self._state = (True, False, remaining - code)
                return
            if remaining == _NO_LIMIT:
                return
        elif code == _ESCAPE or escaped:
            in_string, escaped = _scan(self._tables.bytes[token_id], in_string, escaped)
        elif code == _ODD:
            in_string = not in_string
        self._state = (in_string, escaped, self._probe(exact, superset) if in_string else _NO_LIMIT)

    def _probe(self, exact: Any, superset: Any) -> int:
        run = self._probe_run
        if superset.validate_tokens(run) < len(run):
            return _NO_LIMIT
        room = exact.validate_tokens(run)
        if room < len(run):
            return room
        # Room past the schema's longest bound: this string has none. Else (bounds over the
        # probe's length) it is not known yet.
        return _NO_LIMIT if len(run) > self._longest_bound else _PROBE

    @property
    def keep(self) -> np.ndarray | None:
        """The mask to AND into the superset's, or None when nothing is to be dropped."""
        remaining = self._state[2]
        if remaining < 0 or remaining >= self._tables.longest:
            return None
        return self._tables.keep(remaining)

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` tokens; past the kept history, count no more
        (the quote parity is lost; the twin's masks stay as they are)."""
        history = self._history
        if history is None or num_tokens > len(history):
            self._state, self._history = (False, False, _NO_LIMIT), None
        elif num_tokens:
            self._state = history[-num_tokens]
            del history[-num_tokens:]

    def copy(self) -> CountedString:
        twin = CountedString.__new__(CountedString)
        twin._tables, twin._codes, twin._probe_run = self._tables, self._codes, self._probe_run
        twin._longest_bound, twin._state = self._longest_bound, self._state
        twin._history = list(self._history) if self._history is not None else None
        return twin


def _scan(data: bytes, in_string: bool, escaped: bool) -> tuple[bool, bool]:
    """The quote parity and escape state after `data`, byte by byte."""
    for byte in data:
        if escaped:
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = in_string
        elif byte == 0x22:  # quote
            in_string = not in_string
    return in_string, escaped
