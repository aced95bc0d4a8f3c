"""Reading one `{"name": ..., "arguments": {...}}` call object as it streams (hermes, llama3_json,
mistral's list form).

Two paths, chosen once the prefix decides it:

    {"name": "f", "arguments": {"a": 1}}     header first: the call starts at once and the
                 '--- streamed ---'           arguments stream as written
    {"arguments": {...}, "name": "f"}        any other shape: held until the object closes,
                                              then parsed whole (or given back as text)
"""

from __future__ import annotations

from enum import Enum

from atlas.domain.text.tool_calls.base import ToolCallParser
from atlas.domain.text.tool_calls.json_scan import (
    CallHeader,
    HeaderStatus,
    JsonEndScanner,
    match_call_header,
    parse_call_object,
)


class ReadStatus(Enum):
    NEED_MORE = "need_more"
    DONE = "done"  # the object ended; the call was emitted
    FAILED = "failed"  # not a call: `JsonCallReader.raw_text` goes out as content


class _Path(Enum):
    HEADER = "header"
    STREAMING = "streaming"
    AFTER_ARGUMENTS = "after_arguments"
    BUFFERED = "buffered"


class JsonCallReader:
    """Reads one call object into `parser`, from the object's opening brace."""

    __slots__ = ("_parser", "_path", "_object", "_arguments", "_raw")

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._path = _Path.HEADER
        self._object = JsonEndScanner()
        self._arguments = JsonEndScanner()
        self._raw = ""  # the object's text while undecided (header or buffered path)

    @property
    def raw_text(self) -> str:
        """The text read so far, while no call has been emitted (for the content fallback)."""
        return self._raw

    def read(self, text: str, final: bool) -> tuple[int, ReadStatus]:
        """Read from `text` up to the object's end; (characters consumed, status)."""
        end = self._object.feed(text)
        part = text if end is None else text[:end]
        closed = end is not None
        if self._path is _Path.HEADER:
            self._raw += part
            header = match_call_header(self._raw)
            if header is HeaderStatus.NEED_MORE and not (closed or final):
                return len(part), ReadStatus.NEED_MORE
            if isinstance(header, CallHeader) and self._raw[header.arguments_idx] == "{":
                self._parser.begin_call(header.name)
                self._path = _Path.STREAMING
                self._stream_arguments(self._raw[header.arguments_idx :])
                self._raw = ""
            else:
                self._path = _Path.BUFFERED
        elif self._path is _Path.STREAMING:
            self._stream_arguments(part)
        elif self._path is _Path.BUFFERED:
            self._raw += part
        if not (closed or final):
            return len(part), ReadStatus.NEED_MORE
        return len(part), self._close()

    def _stream_arguments(self, text: str) -> None:
        end = self._arguments.feed(text)
        self._parser.add_arguments(text if end is None else text[:end])
        if end is not None:
            self._path = _Path.AFTER_ARGUMENTS  # other keys up to the object's end are dropped

    def _close(self) -> ReadStatus:
        if self._path is not _Path.BUFFERED:
            self._parser.end_call()
            return ReadStatus.DONE
        call = parse_call_object(self._raw, self._parser.tool_names)
        if call is None:
            return ReadStatus.FAILED
        name, arguments = call
        self._parser.begin_call(name)
        self._parser.add_arguments(arguments)
        self._parser.end_call()
        return ReadStatus.DONE
