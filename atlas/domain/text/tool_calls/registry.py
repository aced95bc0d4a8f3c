"""Tool-call parsers by `--tool-call-parser` name, and which one a chat template implies."""

from __future__ import annotations

import random
from collections.abc import Sequence

from atlas.domain.text.tool_calls.base import ToolCallParser
from atlas.domain.text.tool_calls.calls import ToolCallsResult
from atlas.domain.text.tool_calls.hermes import HermesParser
from atlas.domain.text.tool_calls.llama3_json import Llama3JsonParser
from atlas.domain.text.tool_calls.mistral import MistralParser
from atlas.domain.text.tool_calls.qwen3_coder import Qwen3CoderParser
from atlas.ports.grammar import FunctionTool

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Qwen3CoderParser, Llama3JsonParser, MistralParser)
}


def tool_call_parser_class(name: str) -> type[ToolCallParser]:
    """The parser class of `--tool-call-parser` `name`; raises ValueError naming the choices."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--tool-call-parser: unknown parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
        ) from None


def create_tool_call_parser(name: str, tools: Sequence[FunctionTool], rng: random.Random) -> ToolCallParser:
    """A fresh parser for one sequence; `rng` draws its call ids."""
    return tool_call_parser_class(name)(tools, rng)


def parse_tool_calls(name: str, text: str, tools: Sequence[FunctionTool], rng: random.Random) -> ToolCallsResult:
    """The non-streamed parse of a whole output (what a stream's deltas concatenate to)."""
    parser = create_tool_call_parser(name, tools, rng)
    parser.push(text)
    parser.finish()
    return parser.result()


def detect_tool_call_parser(chat_template: str) -> str | None:
    """The parser whose markup a chat template writes for assistant tool calls, or None.

    Qwen3-Coder's XML tags are checked before hermes' `<tool_call>`, which its templates also use.
    """
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and "<|start_header_id|>" in chat_template):
        return "llama3_json"
    return None
