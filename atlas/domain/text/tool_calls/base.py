"""The streaming frame every tool-call parser shares: buffering, emission, content spacing.

A parser is a state machine over the text not yet consumed. `push` appends a chunk and runs
`_step` until it needs more text; `finish` runs it once more with `final` set, so every
pending decision resolves. A step decides only from the text it has (a marker split across
chunks waits), so any chunking of the same text yields the same deltas, and the deltas
concatenated equal `result()`, the non-streamed parse.

Content spacing: whitespace between the answer and a call, between calls, and after the last
call is padding of the markup and dropped; all other text keeps its exact characters.

Malformed markup: a block is text until the parser has read a call's name and the start of
its arguments object; what fails before that point comes out as content, markup included.
After it the call is sent, and its arguments are the characters the model wrote until their
brackets balance (a call cut off by max_tokens keeps the arguments written so far).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from atlas.domain.text.tool_calls.calls import (
    ToolCall,
    ToolCallDelta,
    ToolCallsDelta,
    ToolCallsResult,
    openai_call_id,
)
from atlas.ports.grammar import FunctionTool


class ToolCallParser:
    """Turns one sequence's streamed answer text into content and tool-call deltas.

    Subclasses implement `_step`; they consume `self._buffer` with `_take` and report through
    `_emit_content`, `begin_call`, `add_arguments` and `end_call` (public for the markup readers they share).
    """

    name = ""
    # The markup relies on special tokens (mistral's [TOOL_CALLS]): detokenize with
    # skip_special_tokens=False for this parser to see them.
    needs_special_tokens = False

    def __init__(self, tools: Sequence[FunctionTool], rng: random.Random) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._rng = rng
        self._buffer = ""
        self._final = False
        self._content_parts: list[str] = []
        self._calls: list[list[str]] = []  # [id, name, arguments pieces...] per call
        self._delta_content: list[str] = []
        self._delta_calls: list[ToolCallDelta] = []
        self._held_space = ""  # trailing whitespace of the content: dropped if a call follows
        self._after_call = False  # leading whitespace of content after a call is dropped
        self._call_open = False

    # -- public ------------------------------------------------------------------------------

    def push(self, text: str) -> ToolCallsDelta:
        """Feed the next chunk of answer text; return what is certain now."""
        if self._final:
            raise ValueError("push after finish: the parser has seen the whole text")
        self._buffer += text
        self._run()
        return self._take_delta()

    def finish(self) -> ToolCallsDelta:
        """End of the text: resolve what was held (partial markup is content after all)."""
        if not self._final:
            self._final = True
            self._run()
            if self._buffer:
                self._emit_content(self._take(len(self._buffer)))
            if self._call_open:
                self.end_call()
            self._content_parts.append(self._held_space)
            self._delta_content.append(self._held_space)
            self._held_space = ""
        return self._take_delta()

    @property
    def tool_names(self) -> frozenset[str]:
        """Names of the request's tools."""
        return frozenset(self._tools)

    def result(self) -> ToolCallsResult:
        """Everything emitted so far as one result (call `finish` first for the whole text)."""
        calls = tuple(ToolCall(call[0], call[1], "".join(call[2:])) for call in self._calls)
        return ToolCallsResult("".join(self._content_parts), calls)

    # -- for subclasses ----------------------------------------------------------------------

    def _step(self) -> bool:
        """Consume some of `self._buffer`; False when nothing more can be decided yet."""
        raise NotImplementedError

    def _take(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _new_call_id(self) -> str:
        return openai_call_id(self._rng)

    def _emit_content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            self._content_parts.append(body)
            self._delta_content.append(body)

    def begin_call(self, name: str) -> None:
        if self._call_open:
            self.end_call()
        self._held_space = ""
        self._after_call = False
        call_id = self._new_call_id()
        self._calls.append([call_id, name])
        self._delta_calls.append(ToolCallDelta(len(self._calls) - 1, call_id, name))
        self._call_open = True

    def add_arguments(self, text: str) -> None:
        if not text:
            return
        self._calls[-1].append(text)
        last = self._delta_calls[-1] if self._delta_calls else None
        index = len(self._calls) - 1
        if last is not None and last.index == index:  # merge pieces of one chunk into one delta
            self._delta_calls[-1] = ToolCallDelta(index, last.id, last.name, last.arguments + text)
        else:
            self._delta_calls.append(ToolCallDelta(index, arguments=text))

    def end_call(self) -> None:
        self._call_open = False
        self._after_call = True

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        # At the end a step runs even on an empty buffer: a pending block must resolve.
        while (self._buffer or self._final) and self._step():
            pass

    def _take_delta(self) -> ToolCallsDelta:
        delta = ToolCallsDelta("".join(self._delta_content), tuple(self._delta_calls))
        self._delta_content.clear()
        self._delta_calls.clear()
        return delta


def find_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """(index, marker) of the earliest marker in `text`, or None."""
    best: tuple[int, str] | None = None
    for marker in markers:
        idx = text.find(marker)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, marker)
    return best


def partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    longest = max((len(marker) - 1 for marker in markers), default=0)
    for size in range(min(longest, len(text)), 0, -1):
        tail = text[-size:]
        if any(marker.startswith(tail) for marker in markers):
            return size
    return 0


def strip_leading_whitespace(parser_buffer: str) -> int:
    """Number of whitespace characters at the start of `parser_buffer`."""
    return len(parser_buffer) - len(parser_buffer.lstrip())


ParserFactory = Callable[[Sequence[FunctionTool], random.Random], ToolCallParser]
