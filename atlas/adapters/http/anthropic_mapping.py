"""Anthropic Messages <-> the internal chat turn: messages, tools, thinking, sampling, output blocks.

Request side:

    system (string or text blocks)        -> a system message
    user text blocks                      -> a user message (blocks joined by newlines)
    user tool_result blocks               -> role "tool" messages (before the user's text)
    assistant text / tool_use / thinking  -> content / tool_calls (arguments as JSON) / reasoning_content
    tools, tool_choice auto|any|tool|none -> ToolsRequest (auto|required|named|none);
                                             disable_parallel_tool_use -> one call at most
    thinking enabled (budget_tokens)      -> enable_thinking + a thinking budget; disabled -> no thinking;
                                             adaptive, between_tools -> enable_thinking, the model decides
    output_config.effort                  -> a thinking budget (low 1024 ... xhigh 32768; max: none)
    output_config.format (json_schema)    -> structured output
    image and document blocks             -> a 400 (text-only models)

Output side: a choice's reasoning is a `thinking` block, its content a `text` block, each call
a `tool_use` block; the finish is `end_turn`, `tool_use`, `stop_sequence` or `max_tokens`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from atlas.adapters.http.anthropic_schemas import (
    AnthropicMessage,
    AnthropicToolChoice,
    ContentOut,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    SystemBlock,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingOut,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    PromptFields,
)
from atlas.adapters.http.chat_choices import ChatChoices
from atlas.adapters.http.chat_turn import ChatTurn, StructuredOutput, ThinkingBudget, ToolChoice, ToolsRequest
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.params import RequestedSampling
from atlas.ports.grammar import FunctionTool, JsonSchema

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# output_config.effort as thinking budgets: OpenAI's levels, then one more step of 2x; "max" has no cap.
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


def anthropic_turn(request: PromptFields) -> ChatTurn:
    """The turn a messages (or count_tokens) body asks for; 400 naming the block for images."""
    template_kwargs: dict[str, Any] = {}
    budget = None
    config = request.output_config
    if config is not None and config.effort in EFFORT_BUDGETS:
        budget = ThinkingBudget(EFFORT_BUDGETS[config.effort], "output_config.effort")
    if isinstance(request.thinking, ThinkingEnabled):
        budget = ThinkingBudget(request.thinking.budget_tokens, "thinking.budget_tokens")
    if request.thinking is not None:
        template_kwargs["enable_thinking"] = not isinstance(request.thinking, ThinkingDisabled)
    structured = None
    if config is not None and config.format is not None:
        structured = StructuredOutput(JsonSchema(config.format.schema), "output_config.format.schema")
    return ChatTurn(
        messages=chat_messages(request.system, request.messages),
        tools=tools_request(request.tools, request.tool_choice),
        structured=structured,
        thinking_budget=budget,
        template_kwargs=template_kwargs,
    )


def requested_sampling(request: MessagesRequest) -> RequestedSampling:
    """The request's sampling fields; 400 for a thinking budget that is not below max_tokens
    (the thinking counts toward max_tokens, as Anthropic's API requires)."""
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= request.max_tokens:
        raise bad_request("thinking.budget_tokens", f"thinking.budget_tokens ({thinking.budget_tokens}) must be "
                                                    f"less than max_tokens ({request.max_tokens}): the thinking "
                                                    f"counts toward max_tokens")
    return RequestedSampling(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=tuple(request.stop_sequences or ()),
        stop_field="stop_sequences",
    )


def chat_messages(system: str | list[SystemBlock] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Template-ready messages; 400 naming `messages[i].content[j]` for a block a text model cannot take,
    and `messages[i].content` for an empty one (Anthropic's rule: only a final assistant message,
    the reply's prefill, may be empty)."""
    result: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "\n".join(block.text for block in system)
        result.append({"role": "system", "content": text})
    last = len(messages) - 1
    for idx, message in enumerate(messages):
        if not message.content and not (idx == last and message.role == "assistant"):
            field = f"messages[{idx}].content"
            raise bad_request(field, f"{field} is empty; every message needs content, but for a final assistant "
                                     "message (the start of the reply)")
        if isinstance(message.content, str):
            result.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            result.extend(_user_messages(message.content, f"messages[{idx}].content"))
        else:
            result.append(_assistant_message(message.content, f"messages[{idx}].content"))
    return result


def _user_messages(blocks: list, field: str) -> list[dict[str, Any]]:
    tool_results = []
    texts = []
    for idx, block in enumerate(blocks):
        where = f"{field}[{idx}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            tool_results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": _tool_result_text(block, where)})
        else:
            raise _unsupported_block(block, where, "a user message")
    if texts or not tool_results:
        tool_results.append({"role": "user", "content": "\n".join(texts)})
    return tool_results


def _tool_result_text(block: ToolResultBlock, field: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for idx, part in enumerate(block.content):
        if not isinstance(part, TextBlock):
            raise _unsupported_block(part, f"{field}.content[{idx}]", "a tool result")
        texts.append(part.text)
    return "\n".join(texts)


def _assistant_message(blocks: list, field: str) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for idx, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking is someone else's: dropped
            raise _unsupported_block(block, f"{field}[{idx}]", "an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _unsupported_block(block: object, field: str, where: str):
    if isinstance(block, (ImageBlock, DocumentBlock)):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        return bad_request(field, f"{kind} blocks are not supported: this model takes text only")
    kind = type(block).__name__.removesuffix("Block")
    return bad_request(field, f"a {kind} block cannot appear in {where}")


def tools_request(tools: list | None, choice: AnthropicToolChoice | None) -> ToolsRequest | None:
    if not tools and not isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
        return None
    functions = tuple(FunctionTool(tool.name, dict(tool.input_schema), tool.description or "") for tool in tools or ())
    if choice is None or isinstance(choice, ToolChoiceNone):
        mode, named, parallel = (ToolChoice.NONE if choice is not None else ToolChoice.AUTO), None, True
    else:
        parallel = not choice.disable_parallel_tool_use
        if isinstance(choice, ToolChoiceTool):
            mode, named = ToolChoice.NAMED, choice.name
        else:
            mode, named = (ToolChoice.REQUIRED if isinstance(choice, ToolChoiceAny) else ToolChoice.AUTO), None
    return ToolsRequest(functions, mode, named, parallel)


# -- output -----------------------------------------------------------------------------------


def thinking_signature(thinking: str) -> str:
    """An opaque signature for a thinking block (Anthropic's clients expect one); this server
    does not check it when the block comes back."""
    return hashlib.sha256(thinking.encode("utf-8", "replace")).hexdigest()


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object Anthropic's `input` is, or None when they are not one
    (a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def content_blocks(choices: ChatChoices, index: int) -> list[ContentOut]:
    """A finished choice as Anthropic content blocks: thinking, text, then tool uses. A call
    whose arguments are not a JSON object is returned as text, never dropped."""
    blocks: list[ContentOut] = []
    reasoning = choices.reasoning(index)
    if reasoning is not None:
        blocks.append(ThinkingOut(reasoning, thinking_signature(reasoning)))
    text = choices.content(index)
    uses = []
    for call in choices.tool_calls(index):
        arguments = tool_input(call.arguments)
        if arguments is None:
            text += call.arguments
        else:
            uses.append(ToolUseOut(anthropic_tool_id(call.id), call.name, arguments))
    if text or not uses:
        blocks.append(TextOut(text))
    return blocks + uses


def anthropic_tool_id(call_id: str) -> str:
    """Anthropic's `toolu_` prefix on a call id."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(choices: ChatChoices, index: int) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice. A choice ended by the server
    (shutdown, abort) reads as `end_turn`."""
    reason = choices.finish_reason(index)
    if reason == "length":
        return "max_tokens", None
    stop = choices.stop_reason(index)
    if isinstance(stop, str):
        return "stop_sequence", stop
    if choices.tool_calls(index):
        return "tool_use", None
    return "end_turn", None
