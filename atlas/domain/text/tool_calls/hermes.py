"""The `hermes` markup (Hermes 2/3, Qwen2.5, Qwen3): JSON objects in `<tool_call>` tags.

    I'll check both.\\n
    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>\\n
    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Rome"}}\\n</tool_call>

A block whose body is not a call object is content, tags included. Text between the object
and `</tool_call>` (Qwen2.5 sometimes doubles the closing brace) is dropped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import Enum

from atlas.domain.text.tool_calls.base import ToolCallParser, find_marker, partial_marker_length
from atlas.domain.text.tool_calls.json_call import JsonCallReader, ReadStatus
from atlas.ports.grammar import FunctionTool

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _State(Enum):
    CONTENT = "content"
    BLOCK_START = "block_start"  # after <tool_call>, before the object
    OBJECT = "object"
    BLOCK_END = "block_end"  # after an object, before </tool_call>


class HermesParser(ToolCallParser):
    name = "hermes"

    def __init__(self, tools: Sequence[FunctionTool], rng: random.Random) -> None:
        super().__init__(tools, rng)
        self._state = _State.CONTENT
        self._block_text = ""  # the block read so far, given back as content if it is no call
        self._reader: JsonCallReader | None = None

    def _step(self) -> bool:
        if self._state is _State.CONTENT:
            return self._content()
        if self._state is _State.BLOCK_START:
            return self._block_start()
        if self._state is _State.OBJECT:
            return self._object()
        return self._block_end()

    def _content(self) -> bool:
        found = find_marker(self._buffer, (OPEN_TAG,))
        if found is None:
            keep = 0 if self._final else partial_marker_length(self._buffer, (OPEN_TAG,))
            self._emit_content(self._take(len(self._buffer) - keep))
            return False
        self._emit_content(self._take(found[0]))
        self._block_text = self._take(len(OPEN_TAG))
        self._state = _State.BLOCK_START
        return True

    def _block_start(self) -> bool:
        body = self._buffer.lstrip()
        if not body and not self._final:
            return False
        self._block_text += self._take(len(self._buffer) - len(body))
        if body.startswith("{"):
            self._reader = JsonCallReader(self)
            self._state = _State.OBJECT
            return True
        return self._give_back()

    def _object(self) -> bool:
        assert self._reader is not None
        num_read, status = self._reader.read(self._buffer, self._final)
        if status is ReadStatus.FAILED:
            self._block_text += self._reader.raw_text
            self._take(num_read)
            return self._give_back()
        self._take(num_read)
        if status is ReadStatus.DONE:
            self._state = _State.BLOCK_END
            return True
        return False

    def _block_end(self) -> bool:
        body = self._buffer.lstrip()
        if body.startswith("{"):  # another object in the same block
            self._take(len(self._buffer) - len(body))
            self._block_text = ""
            self._reader = JsonCallReader(self)
            self._state = _State.OBJECT
            return True
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0:
            self._take(end + len(CLOSE_TAG))
            self._state = _State.CONTENT
            return True
        if self._final:
            self._state = _State.CONTENT  # an unclosed block: what follows the call is content
            return True
        return False

    def _give_back(self) -> bool:
        """The block is not a call: its text so far is content, and parsing goes on after it."""
        self._emit_content(self._block_text)
        self._block_text = ""
        self._state = _State.CONTENT
        return True
