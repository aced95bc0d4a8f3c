"""Chat choices read back: each choice's text split into reasoning, content and tool calls.

`ChatChoices.apply` feeds one choice's new text (a `ChoiceUpdate`) through that choice's
`ChatOutputParser` and returns the `ChoiceParts` every API streams from: reasoning, content,
tool-call pieces (id and name in a call's first piece, then pieces of its arguments), and
the finish once the choice ends, when the parser releases what it held back. The whole of
each choice is kept for non-streamed answers. With `parallel_tool_calls` false only the
first call is kept.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from atlas.adapters.http.chat_turn import OutputReading
from atlas.adapters.http.choices import ChoiceUpdate
from atlas.domain.batch import TokenLogprobs
from atlas.domain.text.chat_output import ChatDelta, ChatOutputParser
from atlas.domain.text.tool_calls import ToolCall, ToolCallDelta


@dataclass(frozen=True, slots=True)
class ChoiceParts:
    """What one update adds to one choice, split."""

    index: int
    reasoning: str
    content: str
    tool_calls: tuple[ToolCallDelta, ...]
    num_tokens: int
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # the engine's: stop, length, abort
    stop_reason: str | int | None

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class _Choice:
    __slots__ = ("parser", "reasoning", "content", "calls", "finish_reason", "stop_reason", "num_reasoning_tokens")

    def __init__(self, parser: ChatOutputParser | None) -> None:
        self.parser = parser
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[list[str]] = []  # [id, name, arguments pieces...]
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_reasoning_tokens = 0


class ChatChoices:
    """The parsed output of every choice of one request."""

    def __init__(self, num_choices: int, reading: OutputReading, rng: random.Random) -> None:
        self._choices = [_Choice(reading.parser(rng)) for _ in range(num_choices)]
        self._parallel = reading.parallel_tool_calls

    def apply(self, update: ChoiceUpdate) -> ChoiceParts:
        """Split what `update` adds to its choice (and everything held back, when it finishes)."""
        choice = self._choices[update.index]
        delta = self._parse(choice, update)
        calls = delta.tool_calls if self._parallel else tuple(c for c in delta.tool_calls if c.index == 0)
        if delta.reasoning:
            choice.reasoning.append(delta.reasoning)
            if not (delta.content or calls):
                choice.num_reasoning_tokens += update.num_tokens
        if delta.content:
            choice.content.append(delta.content)
        for call in calls:
            if call.id is not None:
                choice.calls.append([call.id, call.name or ""])
            choice.calls[call.index].append(call.arguments)
        if update.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
        return ChoiceParts(update.index, delta.reasoning, delta.content, calls, update.num_tokens, update.logprobs,
                           update.finish_reason, update.stop_reason)

    @staticmethod
    def _parse(choice: _Choice, update: ChoiceUpdate) -> ChatDelta:
        if choice.parser is None:
            return ChatDelta(content=update.text)
        delta = choice.parser.push(update.text) if update.text else ChatDelta()
        if update.finish_reason is None:
            return delta
        last = choice.parser.finish()
        return ChatDelta(delta.reasoning + last.reasoning, delta.content + last.content,
                         delta.tool_calls + last.tool_calls)

    @property
    def num_choices(self) -> int:
        return len(self._choices)

    def reasoning(self, index: int) -> str | None:
        """The choice's reasoning, or None when it wrote none."""
        return "".join(self._choices[index].reasoning) or None

    def content(self, index: int) -> str:
        return "".join(self._choices[index].content)

    def tool_calls(self, index: int) -> list[ToolCall]:
        return [ToolCall(call[0], call[1], "".join(call[2:])) for call in self._choices[index].calls]

    def finish_reason(self, index: int) -> str | None:
        """The engine's finish reason: stop, length or abort (None while running)."""
        return self._choices[index].finish_reason

    def stop_reason(self, index: int) -> str | int | None:
        return self._choices[index].stop_reason

    def num_reasoning_tokens(self, index: int) -> int:
        """Tokens whose text went to the reasoning alone (a token that ends the block counts
        with the answer)."""
        return self._choices[index].num_reasoning_tokens

    def openai_finish_reason(self, index: int) -> str | None:
        """OpenAI's: `tool_calls` when the choice stopped after calling tools."""
        reason = self._choices[index].finish_reason
        if reason == "stop" and self._choices[index].calls:
            return "tool_calls"
        return reason
