"""Incremental reading of JSON written by a model: where an object ends, and a call's header.

Tool-call markup wraps JSON objects (`{"name": "f", "arguments": {...}}`). To stream the
arguments while they are written, a parser must know where a JSON value ends without parsing
it: `JsonEndScanner` tracks string/escape state and bracket depth across chunks. To send the
call's name first, `match_call_header` recognises the common key order (name, then arguments)
on a prefix, saying "need more text" while the prefix may still become one.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass
from enum import Enum

_WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


class JsonEndScanner:
    """Finds the end of one JSON object or array fed in chunks that start at its first bracket.

    Brackets are counted outside strings only; whether the text is valid JSON is not checked
    (a malformed value still ends where its brackets balance).
    """

    __slots__ = ("_depth", "_in_string", "_escaped", "_done")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's closing bracket, or None if it goes on."""
        if self._done:
            return 0
        for idx, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._done = True
                    return idx + 1
        return None


class HeaderStatus(Enum):
    NEED_MORE = "need_more"  # the text so far may still become a header
    NO_MATCH = "no_match"  # not `{"name": "...", "arguments": ` (another key order, or not JSON)


@dataclass(frozen=True, slots=True)
class CallHeader:
    """`{"name": "<name>", "arguments": ` matched; the arguments value starts at `arguments_idx`."""

    name: str
    arguments_idx: int


def match_call_header(text: str) -> CallHeader | HeaderStatus:
    """Match `{ "name" : <string> , "arguments"|"parameters" : <first char of value>` on a prefix."""
    idx = 0
    for expected in ("{", "name", ":", None, ",", ARGUMENT_KEYS, ":"):
        idx = _skip_whitespace(text, idx)
        if idx >= len(text):
            return HeaderStatus.NEED_MORE
        if expected in ("{", ":", ","):
            if text[idx] != expected:
                return HeaderStatus.NO_MATCH
            idx += 1
            continue
        value = _read_string(text, idx)
        if isinstance(value, HeaderStatus):
            return value
        string_value, idx = value
        if expected is None:
            name = string_value
        elif (string_value != expected) if isinstance(expected, str) else (string_value not in expected):
            return HeaderStatus.NO_MATCH
    idx = _skip_whitespace(text, idx)
    if idx >= len(text):
        return HeaderStatus.NEED_MORE
    if not name:
        return HeaderStatus.NO_MATCH
    return CallHeader(name, idx)


def _skip_whitespace(text: str, idx: int) -> int:
    while idx < len(text) and text[idx] in _WHITESPACE:
        idx += 1
    return idx


def _read_string(text: str, idx: int) -> tuple[str, int] | HeaderStatus:
    """(decoded string, index past its closing quote) of the JSON string at `idx`."""
    if text[idx] != '"':
        return HeaderStatus.NO_MATCH
    end = idx + 1
    while end < len(text):
        char = text[end]
        if char == "\\":
            end += 2
            continue
        if char == '"':
            try:
                return json.loads(text[idx : end + 1]), end + 1
            except json.JSONDecodeError:
                return HeaderStatus.NO_MATCH
        if char == "\n":  # a raw newline cannot be inside a JSON string
            return HeaderStatus.NO_MATCH
        end += 1
    return HeaderStatus.NEED_MORE


def parse_call_object(text: str, tool_names: Container[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole `{"name": ..., "arguments": {...}}` in any key order.

    `parameters` is accepted for `arguments`, and arguments written as a JSON string holding an
    object are unwrapped. Arguments may be left out only when the name is one of `tool_names`
    (so `{"name": "John", "age": 30}` stays an answer). None when the text is not such an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in ARGUMENT_KEYS if key in value), None)
    if key is None and value["name"] not in tool_names:
        return None
    arguments = value[key] if key is not None else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
