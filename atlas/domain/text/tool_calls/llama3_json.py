"""The `llama3_json` markup (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole answer is calls.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

Calls start the output (after whitespace and an optional `<|python_tag|>`, which only shows up
when special tokens are kept) and are separated by `;` or whitespace. An output that starts
otherwise is all content; so is one whose first object is not a call (`{"name": "John"}`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import Enum

from atlas.domain.text.tool_calls.base import ToolCallParser
from atlas.domain.text.tool_calls.json_call import JsonCallReader, ReadStatus
from atlas.ports.grammar import FunctionTool

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    START = "start"
    OBJECT = "object"
    BETWEEN = "between"  # after a call: `;`, another object, or trailing text
    PLAIN = "plain"  # no (more) calls: everything is content


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def __init__(self, tools: Sequence[FunctionTool], rng: random.Random) -> None:
        super().__init__(tools, rng)
        self._state = _State.START
        self._pending = ""  # text read before the first call, given back if there is none
        self._reader: JsonCallReader | None = None

    def _step(self) -> bool:
        if self._state is _State.START:
            return self._start()
        if self._state is _State.OBJECT:
            return self._object()
        if self._state is _State.BETWEEN:
            return self._between()
        self._emit_content(self._take(len(self._buffer)))
        return False

    def _start(self) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(PYTHON_TAG):
            self._pending += self._take(len(self._buffer) - len(body) + len(PYTHON_TAG))
            return True
        if body.startswith("{"):
            self._pending += self._take(len(self._buffer) - len(body))
            self._reader = JsonCallReader(self)
            self._state = _State.OBJECT
            return True
        if not self._final and (not body or PYTHON_TAG.startswith(body)):
            return False
        self._emit_content(self._pending)
        self._state = _State.PLAIN
        return True

    def _object(self) -> bool:
        assert self._reader is not None
        num_read, status = self._reader.read(self._buffer, self._final)
        self._take(num_read)
        if status is ReadStatus.FAILED:
            self._emit_content(self._pending + self._reader.raw_text)
            self._state = _State.PLAIN
            return True
        self._pending = ""
        if status is ReadStatus.DONE:
            self._state = _State.BETWEEN
            return True
        return False

    def _between(self) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(";"):
            body = body[1:].lstrip()
            if not body and not self._final:
                return False  # `; ` then maybe another call
        if body.startswith("{"):
            self._pending = self._take(len(self._buffer) - len(body))
            self._reader = JsonCallReader(self)
            self._state = _State.OBJECT
            return True
        if not body and not self._final:
            return False
        self._state = _State.PLAIN
        return True
