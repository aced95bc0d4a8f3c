"""Tool calls in model output: one incremental parser per markup, and a registry by name."""

from atlas.domain.text.tool_calls.base import ToolCallParser
from atlas.domain.text.tool_calls.calls import ToolCall, ToolCallDelta, ToolCallsDelta, ToolCallsResult
from atlas.domain.text.tool_calls.registry import (
    TOOL_CALL_PARSERS,
    create_tool_call_parser,
    detect_tool_call_parser,
    parse_tool_calls,
    tool_call_parser_class,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallsDelta",
    "ToolCallsResult",
    "create_tool_call_parser",
    "detect_tool_call_parser",
    "parse_tool_calls",
    "tool_call_parser_class",
]
