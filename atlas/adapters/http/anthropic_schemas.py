"""Anthropic Messages API bodies (POST /v1/messages, /v1/messages/count_tokens), validated by msgspec.

As for OpenAI's bodies (`schemas`): the top level forbids unknown fields, every field
Anthropic defines is declared (those that change nothing here are ignored, those that would
change the answer and are not supported are rejected by `unsupported_anthropic_features`),
content blocks ignore unknown keys (`cache_control`, `citations`), and every number and size
is bounded. Image and document blocks are declared so that they get a clear 400, not an
"unknown type".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from atlas.adapters.http.schemas import (
    INT32_MAX,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    Count,
    StopString,
    TokenCount,
    ToolName,
)
from atlas.domain.requests import MAX_STOP_STRINGS

# -- request --------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageBlock(msgspec.Struct, tag_field="type", tag="image"):
    source: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document"):
    source: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: ToolName
    input: dict[str, Any]


ToolResultContent = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | Annotated[list[ToolResultContent], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking"):
    data: str


ContentBlock = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                | RedactedThinkingBlock)


class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Meta(max_length=MAX_CONTENT_PARTS)]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: ToolName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) have other types: a 400


class ToolChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(msgspec.Struct, tag_field="type", tag="any", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(msgspec.Struct, tag_field="type", tag="tool", kw_only=True):
    name: ToolName
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none"):
    pass


AnthropicToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", kw_only=True):
    budget_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)]


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive", kw_only=True):
    display: Literal["summarized", "omitted"] | None = None  # ignored: the thinking is returned whole


class ThinkingBetweenTools(msgspec.Struct, tag_field="type", tag="between_tools"):
    pass


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]  # a plain field: a tagged Struct outside a union takes a missing tag
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class SystemBlock(msgspec.Struct, kw_only=True):
    type: Literal["text"]  # a plain field: a tagged Struct outside a union takes a missing tag
    text: str


Messages = Annotated[list[AnthropicMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
System = str | Annotated[list[SystemBlock], Meta(max_length=MAX_CONTENT_PARTS)]


class PromptFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the prompt is made of: shared by messages and count_tokens."""

    model: str | None = None  # Anthropic requires it; here absent means the served model
    messages: Messages
    system: System | None = None
    tools: Annotated[list[AnthropicTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # rejected when non-empty: no MCP connector here
    cache_control: dict[str, Any] | None = None  # ignored: the prefix cache needs no markers


class MessagesRequest(PromptFields, forbid_unknown_fields=True, kw_only=True):
    max_tokens: TokenCount
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Count | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None  # one tier here
    container: str | dict[str, Any] | None = None  # rejected: no code-execution containers
    context_management: dict[str, Any] | None = None  # ignored: no server-side context editing
    diagnostics: dict[str, Any] | None = None  # ignored: no prompt-cache diagnostics
    inference_geo: str | None = None  # ignored: one place
    speed: Literal["standard", "fast"] | None = None  # ignored: one speed
    user_profile_id: str | None = None  # ignored: no per-user accounting
    workspace_id: str | None = None  # ignored: no workspaces


class CountTokensRequest(PromptFields, forbid_unknown_fields=True, kw_only=True):
    pass


_HELLO = [{"role": "user", "content": "Say hello."}]
MessagesBody = Annotated[MessagesRequest, Meta(examples=[
    {"messages": _HELLO, "max_tokens": 8},
    {"messages": _HELLO, "max_tokens": 8, "stream": True, "system": [{"type": "text", "text": "Be brief."}]},
])]
CountTokensBody = Annotated[CountTokensRequest, Meta(examples=[{"messages": _HELLO}])]


def unsupported_anthropic_features(request: PromptFields) -> tuple[str, str] | None:
    """(field, why) for a field that would change the answer and Atlas does not implement."""
    if request.mcp_servers:
        return "mcp_servers", "MCP servers are not supported: this server runs no MCP connector"
    if isinstance(request, MessagesRequest) and request.container:
        return "container", "code-execution containers are not supported"
    return None


# -- response -------------------------------------------------------------------------------


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str
    citations: None = None


class ThinkingOut(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class AnthropicUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ContentOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage
    role: str = "assistant"


class TokenCountOut(msgspec.Struct):
    input_tokens: int


# -- stream events --------------------------------------------------------------------------


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessageOut


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct):
    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopInfo
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    error: dict[str, str]


StreamEvent = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
               | Ping | ErrorEvent)
