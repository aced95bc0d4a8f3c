"""A chat answer's text split three ways: reasoning, content, tool calls.

The reasoning split runs first and the tool-call parser sees only the answer after the block,
so a call the model drafts while thinking is not a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.text.reasoning import ReasoningSplitter
from atlas.domain.text.tool_calls import ToolCallDelta, ToolCallParser


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What one chunk of output adds (OpenAI's `delta`: reasoning_content, content, tool_calls)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """One sequence's streamed text through the optional reasoning splitter and tool-call parser."""

    __slots__ = ("_reasoning", "_tool_calls")

    def __init__(self, reasoning: ReasoningSplitter | None, tool_calls: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tool_calls = tool_calls

    def push(self, text: str) -> ChatDelta:
        """Feed the next chunk of detokenized text."""
        if self._reasoning is None:
            return self._answer("", text, final=False)
        split = self._reasoning.push(text)
        return self._answer(split.reasoning, split.content, final=False)

    def finish(self) -> ChatDelta:
        """End of the output: everything held back comes out."""
        if self._reasoning is None:
            return self._answer("", "", final=True)
        split = self._reasoning.flush()
        return self._answer(split.reasoning, split.content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self._tool_calls is None:
            return ChatDelta(reasoning, content)
        calls = self._tool_calls.push(content) if content else None
        last = self._tool_calls.finish() if final else None
        parts = [delta for delta in (calls, last) if delta is not None]
        return ChatDelta(
            reasoning,
            "".join(delta.content for delta in parts),
            tuple(call for delta in parts for call in delta.tool_calls),
        )
