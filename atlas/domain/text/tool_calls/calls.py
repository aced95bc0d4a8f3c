"""What a tool-call parser produces: OpenAI-shaped call deltas, finished calls, and call ids."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call number `index`: `id` and `name` in its first delta only, then pieces of
    the arguments' JSON text (OpenAI's `delta.tool_calls[i]`)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A whole call: `arguments` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallsDelta:
    """What one chunk of model text adds: answer text, and call pieces in order."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ToolCallsResult:
    """A whole output: the answer text outside the calls, and the calls in order."""

    content: str
    tool_calls: tuple[ToolCall, ...]


def openai_call_id(rng: random.Random) -> str:
    """`call_` and 24 letters or digits, as OpenAI writes call ids."""
    return "call_" + "".join(rng.choices(_ID_ALPHABET, k=24))


def mistral_call_id(rng: random.Random) -> str:
    """9 letters or digits: Mistral's templates reject any other tool call id."""
    return "".join(rng.choices(_ID_ALPHABET, k=9))
