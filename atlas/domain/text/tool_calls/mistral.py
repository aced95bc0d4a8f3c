"""The `mistral` markup: calls after the `[TOOL_CALLS]` control token, in either of its forms.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3 tokenizers:
                                                                 Mistral-7B v0.3, Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11+: Small 3.2,
                                                                 Magistral, Devstral)

`[TOOL_CALLS]` and `[ARGS]` are special tokens: the text must be detokenized with them kept.
A `[CALL_ID]` the model writes before `[ARGS]` is dropped (ids are ours, 9 characters as
Mistral's templates require).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from enum import Enum

from atlas.domain.text.tool_calls.base import ToolCallParser, find_marker, partial_marker_length
from atlas.domain.text.tool_calls.calls import mistral_call_id
from atlas.domain.text.tool_calls.json_call import JsonCallReader, ReadStatus
from atlas.domain.text.tool_calls.json_scan import JsonEndScanner
from atlas.ports.grammar import FunctionTool

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_MAX_NAME_CHARS = 256 + len(CALL_ID) + 64  # a name, maybe a call id: longer is not markup


class _State(Enum):
    CONTENT = "content"
    AFTER_MARKER = "after_marker"  # after [TOOL_CALLS]: a list, an object or a name
    LIST_ITEM = "list_item"  # inside [...]: an object or the closing bracket
    OBJECT = "object"
    LIST_NEXT = "list_next"  # after an object in the list: `,` or `]`
    NAME = "name"  # name[ARGS] or name[CALL_ID]id[ARGS]
    ARGUMENTS_START = "arguments_start"  # after [ARGS]: the object must open
    ARGUMENTS = "arguments"  # the [ARGS] object, streamed


class MistralParser(ToolCallParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: Sequence[FunctionTool], rng: random.Random) -> None:
        super().__init__(tools, rng)
        self._state = _State.CONTENT
        self._handlers = {
            _State.CONTENT: self._content,
            _State.AFTER_MARKER: self._after_marker,
            _State.LIST_ITEM: self._list_item,
            _State.OBJECT: self._object,
            _State.LIST_NEXT: self._list_next,
            _State.NAME: self._name,
            _State.ARGUMENTS_START: self._arguments_start,
            _State.ARGUMENTS: self._arguments_text,
        }
        self._block_text = ""
        self._in_list = False
        self._reader: JsonCallReader | None = None
        self._pending_name = ""
        self._arguments = JsonEndScanner()

    def _new_call_id(self) -> str:
        return mistral_call_id(self._rng)

    def _step(self) -> bool:
        return self._handlers[self._state]()

    def _content(self) -> bool:
        found = find_marker(self._buffer, (TOOL_CALLS,))
        if found is None:
            keep = 0 if self._final else partial_marker_length(self._buffer, (TOOL_CALLS,))
            self._emit_content(self._take(len(self._buffer) - keep))
            return False
        self._emit_content(self._take(found[0]))
        self._block_text = self._take(len(TOOL_CALLS))
        self._state = _State.AFTER_MARKER
        return True

    def _after_marker(self) -> bool:
        body = self._buffer.lstrip()
        if not body and not self._final:
            return False
        self._block_text += self._take(len(self._buffer) - len(body))
        if body.startswith("["):
            self._block_text += self._take(1)
            self._in_list = True
            self._state = _State.LIST_ITEM
        elif body.startswith("{"):
            self._in_list = False
            self._start_object()
        elif body:
            self._state = _State.NAME
        else:
            return self._give_back()
        return True

    def _list_item(self) -> bool:
        body = self._buffer.lstrip()
        if not body and not self._final:
            return False
        self._block_text += self._take(len(self._buffer) - len(body))
        if body.startswith("{"):
            self._start_object()
            return True
        if body.startswith("]"):
            self._take(1)
            self._state = _State.CONTENT
            return True
        return self._give_back()

    def _object(self) -> bool:
        assert self._reader is not None
        num_read, status = self._reader.read(self._buffer, self._final)
        self._take(num_read)
        if status is ReadStatus.FAILED:
            self._block_text += self._reader.raw_text
            return self._give_back()
        if status is ReadStatus.NEED_MORE:
            return False
        self._block_text = ""
        self._state = _State.LIST_NEXT if self._in_list else _State.CONTENT
        return True

    def _list_next(self) -> bool:
        body = self._buffer.lstrip()
        if not body and not self._final:
            return False
        self._take(len(self._buffer) - len(body))
        if body.startswith(","):
            self._take(1)
            self._state = _State.LIST_ITEM
        else:
            if body.startswith("]"):
                self._take(1)
            self._state = _State.CONTENT
        return True

    def _name(self) -> bool:
        found = find_marker(self._buffer, (ARGS,))
        if found is None:
            if self._final or len(self._buffer) > _MAX_NAME_CHARS:
                return self._give_back()
            return False
        name = self._buffer[: found[0]].split(CALL_ID, 1)[0].strip()
        if not _NAME.fullmatch(name):
            return self._give_back()
        self._block_text += self._take(found[0] + len(ARGS))
        self._pending_name = name
        self._state = _State.ARGUMENTS_START
        return True

    def _arguments_start(self) -> bool:
        body = self._buffer.lstrip()
        if not body and not self._final:
            return False
        if not body.startswith("{"):
            return self._give_back()
        self._take(len(self._buffer) - len(body))
        self._block_text = ""
        self.begin_call(self._pending_name)
        self._arguments = JsonEndScanner()
        self._state = _State.ARGUMENTS
        return True

    def _arguments_text(self) -> bool:
        end = self._arguments.feed(self._buffer)
        self.add_arguments(self._take(len(self._buffer) if end is None else end))
        if end is None and not self._final:
            return False
        self.end_call()
        self._state = _State.CONTENT
        return True

    def _start_object(self) -> None:
        self._reader = JsonCallReader(self)
        self._state = _State.OBJECT

    def _give_back(self) -> bool:
        """Not a call after all: the markup read so far is content."""
        self._emit_content(self._block_text)
        self._block_text = ""
        self._state = _State.CONTENT
        return True
