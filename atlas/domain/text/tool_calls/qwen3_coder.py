"""The `qwen3_coder` markup (Qwen3-Coder, Qwen3-Next): XML-like function and parameter tags.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, one newline trimmed at each end. They become JSON by the tool's
schema: a string parameter (or one the schema does not list) stays a string and streams as it
is written; integer, number, boolean, object and array values are converted when their tag
closes (text that does not convert stays a string). The arguments above come out as
`{"city": "Paris", "days": 3}`. A `<function=` without the `<tool_call>` wrapper is a call too.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from atlas.domain.text.tool_calls.base import ToolCallParser, find_marker, partial_marker_length
from atlas.ports.grammar import FunctionTool

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_MAX_NAME_CHARS = 256


class _State(Enum):
    CONTENT = "content"
    BLOCK_START = "block_start"  # after <tool_call>: <function= must follow
    FUNCTION_NAME = "function_name"  # after <function=, up to >
    BODY = "body"  # between parameters
    PARAMETER_NAME = "parameter_name"  # after <parameter=, up to >
    VALUE = "value"  # a parameter's text, up to </parameter>
    BLOCK_END = "block_end"  # after </function>, before </tool_call>


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"

    def __init__(self, tools: Sequence[FunctionTool], rng: random.Random) -> None:
        super().__init__(tools, rng)
        self._state = _State.CONTENT
        self._handlers = {
            _State.CONTENT: self._content,
            _State.BLOCK_START: self._block_start,
            _State.FUNCTION_NAME: self._function_name,
            _State.BODY: self._body,
            _State.PARAMETER_NAME: self._parameter_name,
            _State.VALUE: self._value,
            _State.BLOCK_END: self._block_end,
        }
        self._block_text = ""
        self._num_parameters = 0
        self._parameter_schema: Mapping[str, Any] = {}
        self._streams_value = False  # a string value goes out as written
        self._value_text = ""  # a typed value, converted when it closes
        self._value_started = False  # its first newline is trimmed
        self._held_newline = False  # a newline that may be the one before </parameter>

    def _step(self) -> bool:
        return self._handlers[self._state]()

    def _content(self) -> bool:
        markers = (OPEN_TAG, FUNCTION)
        found = find_marker(self._buffer, markers)
        if found is None:
            keep = 0 if self._final else partial_marker_length(self._buffer, markers)
            self._emit_content(self._take(len(self._buffer) - keep))
            return False
        self._emit_content(self._take(found[0]))
        self._block_text = self._take(len(found[1]))
        self._state = _State.BLOCK_START if found[1] == OPEN_TAG else _State.FUNCTION_NAME
        return True

    def _block_start(self) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(FUNCTION):
            self._block_text += self._take(len(self._buffer) - len(body) + len(FUNCTION))
            self._state = _State.FUNCTION_NAME
            return True
        if not self._final and FUNCTION.startswith(body):
            return False
        return self._give_back()

    def _function_name(self) -> bool:
        end = self._buffer.find(">")
        if end < 0:
            if self._final or len(self._buffer) > _MAX_NAME_CHARS or "\n" in self._buffer:
                return self._give_back()
            return False
        name = self._buffer[:end].strip()
        if not name or "\n" in name or "<" in name:
            return self._give_back()
        self._take(end + 1)
        self._block_text = ""
        self.begin_call(name)
        self._num_parameters = 0
        self._state = _State.BODY
        return True

    def _body(self) -> bool:
        found = find_marker(self._buffer, (PARAMETER, FUNCTION_END, CLOSE_TAG))
        if found is None:
            if self._final:
                self._close_function()
                self._take(len(self._buffer))
                return False
            self._take(len(self._buffer) - partial_marker_length(self._buffer, (PARAMETER, FUNCTION_END, CLOSE_TAG)))
            return False
        self._take(found[0])  # stray text between parameters is not part of any value
        if found[1] == PARAMETER:
            self._take(len(PARAMETER))
            self._state = _State.PARAMETER_NAME
        else:
            if found[1] == FUNCTION_END:
                self._take(len(FUNCTION_END))
            self._close_function()
            self._state = _State.BLOCK_END
        return True

    def _parameter_name(self) -> bool:
        end = self._buffer.find(">")
        if end < 0:
            if self._final:
                self._close_function()
                self._take(len(self._buffer))
            return False
        key = self._take(end + 1)[:-1].strip()
        self.add_arguments(("{" if self._num_parameters == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self._num_parameters += 1
        tool = self._tools.get(self._calls[-1][1])
        properties = (tool.parameters.get("properties") if tool else None) or {}
        self._parameter_schema = properties.get(key) or {}
        self._streams_value = _is_string(self._parameter_schema)
        self._value_text = ""
        self._value_started = False
        self._held_newline = False
        if self._streams_value:
            self.add_arguments('"')
        self._state = _State.VALUE
        return True

    def _value(self) -> bool:
        terminators = (PARAMETER_END, FUNCTION_END)
        found = find_marker(self._buffer, terminators)
        if found is None:
            keep = 0 if self._final else partial_marker_length(self._buffer, terminators)
            self._add_value_text(self._take(len(self._buffer) - keep))
            if self._final:
                self._close_value()
                self._close_function()
            return False
        self._add_value_text(self._take(found[0]))
        if found[1] == PARAMETER_END:
            self._take(len(PARAMETER_END))
        self._close_value()
        self._state = _State.BODY
        return True

    def _block_end(self) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(CLOSE_TAG):
            self._take(len(self._buffer) - len(body) + len(CLOSE_TAG))
            self._state = _State.CONTENT
            return True
        if not self._final and CLOSE_TAG.startswith(body):
            return False
        self._state = _State.CONTENT  # <function=...> without the wrapper
        return True

    def _add_value_text(self, text: str) -> None:
        if not self._value_started:
            if not text:
                return
            self._value_started = True
            if text.startswith("\n"):
                text = text[1:]
        if self._held_newline:
            text = "\n" + text
            self._held_newline = False
        if text.endswith("\n"):
            text = text[:-1]
            self._held_newline = True
        if self._streams_value:
            self.add_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value_text += text

    def _close_value(self) -> None:
        self._held_newline = False  # the newline before </parameter> is markup
        if self._streams_value:
            self.add_arguments('"')
        else:
            value = convert_parameter(self._value_text, self._parameter_schema)
            self.add_arguments(json.dumps(value, ensure_ascii=False))

    def _close_function(self) -> None:
        self.add_arguments("}" if self._num_parameters else "{}")
        self.end_call()

    def _give_back(self) -> bool:
        self._emit_content(self._block_text)
        self._block_text = ""
        self._state = _State.CONTENT
        return True


def _schema_types(schema: Mapping[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {item for item in kind if isinstance(item, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            if isinstance(option, Mapping):
                types |= _schema_types(option)
    return types


def _is_string(schema: Mapping[str, Any]) -> bool:
    """A value that stays text: a string parameter, or one the schema says nothing about."""
    types = _schema_types(schema) - {"null"}
    return not types or types <= {"string"}


def convert_parameter(text: str, schema: Mapping[str, Any]) -> Any:
    """A typed parameter's text as its JSON value; text that does not convert stays a string."""
    types = _schema_types(schema)
    stripped = text.strip()
    if "null" in types and stripped == "null":
        return None
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in types:
        try:
            return int(stripped)
        except ValueError:
            pass
    if types & {"number", "integer"}:
        try:
            number = float(stripped)
        except ValueError:
            pass
        else:
            if math.isfinite(number):  # JSON has no NaN or infinity
                integral = number.is_integer() and not any(char in stripped for char in ".eE")
                return int(number) if integral else number
    if types & {"object", "array"} or not types <= {"string", "null"}:
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            pass
    return text
