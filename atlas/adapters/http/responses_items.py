"""Responses API items <-> chat messages, and a Responses request as a `ChatTurn`.

Input side (in order; `instructions` first as a system message):

    message (user / system / developer / assistant)   -> that role's message, text parts joined
    reasoning                                          -> reasoning_content of the next assistant message
    function_call                                      -> a tool call on the assistant message it follows
    function_call_output                               -> a role "tool" message
    input_image / input_file / input_audio parts, item_reference -> a 400

Output side (the items themselves are built as the stream goes, `responses_api`): the
conversation continues (for `previous_response_id`) with one assistant message holding the
choice's reasoning, content and calls.
"""

from __future__ import annotations

from typing import Any

from atlas.adapters.http.chat_choices import ChatChoices
from atlas.adapters.http.chat_turn import ChatTurn, StructuredOutput, ThinkingBudget, ToolChoice, ToolsRequest
from atlas.adapters.http.errors import bad_request, excerpt
from atlas.adapters.http.responses_api_schemas import (
    InputContent,
    InputItem,
    ResponsesRequest,
    ResponsesTextFormatJsonObject,
    ResponsesTextFormatJsonSchema,
    ResponsesToolChoiceFunction,
)
from atlas.domain.reasoning_budget import REASONING_EFFORT_BUDGETS
from atlas.ports.grammar import FunctionTool, JsonObject, JsonSchema

_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The request's input as chat messages; 400 naming `input[i]...` for what a text model cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for idx, item in enumerate(items):
        field = f"input[{idx}]"
        if item.type == "message":
            if item.role is None:
                raise bad_request(f"{field}.role", "a message item needs a role")
            message: dict[str, Any] = {"role": "system" if item.role == "developer" else item.role,
                                       "content": _text(item.content, f"{field}.content")}
            if item.role == "assistant" and reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            messages.append(message)
        elif item.type == "reasoning":
            text = _text(item.content, f"{field}.content") if item.content else _text(item.summary, f"{field}.summary")
            if text:
                reasoning.append(text)
        elif item.type == "function_call":
            _assistant_for_calls(messages, reasoning).setdefault("tool_calls", []).append(_call(item, field))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{field}.call_id", "a function_call_output item needs the call_id it answers")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{field}.output")})
        else:
            raise bad_request(f"{field}.type", "item_reference items are not supported; send the item itself")
    return messages


def _assistant_for_calls(messages: list[dict[str, Any]], reasoning: list[str]) -> dict[str, Any]:
    """The assistant message a function_call item belongs to: the last message when it is
    the assistant's (calls of one turn), else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    messages.append(message)
    return message


def _call(item: InputItem, field: str) -> dict[str, Any]:
    for name, value in (("call_id", item.call_id), ("name", item.name), ("arguments", item.arguments)):
        if value is None:
            raise bad_request(f"{field}.{name}", f"a function_call item needs {name}")
    return {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}


def _text(content: str | list[InputContent] | None, field: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for idx, part in enumerate(content):
        if part.type in ("input_image", "input_file", "input_audio"):
            kind = part.type.removeprefix("input_")
            raise bad_request(f"{field}[{idx}]", f"{kind} input is not supported: this model takes text only")
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise bad_request(f"{field}[{idx}]", f"a {excerpt(part.type)} part needs its text")
        texts.append(text)
    return "".join(texts)


def responses_turn(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatTurn:
    """The turn: `instructions`, then `conversation` (the stored one of `previous_response_id`
    followed by `input_messages(request.input)`)."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += conversation
    budget = None
    if request.reasoning is not None and request.reasoning.effort is not None:
        budget = ThinkingBudget(REASONING_EFFORT_BUDGETS[request.reasoning.effort], "reasoning.effort")
    return ChatTurn(messages=messages, tools=_tools(request), structured=_structured(request), thinking_budget=budget,
                    messages_field="input")


def _tools(request: ResponsesRequest) -> ToolsRequest | None:
    choice = request.tool_choice
    named = choice.name if isinstance(choice, ResponsesToolChoiceFunction) else None
    mode = ToolChoice.NAMED if named is not None else ToolChoice(choice or "auto")
    if not request.tools and not mode.is_forced:
        return None
    tools = tuple(FunctionTool(tool.name, dict(tool.parameters or {}), tool.description or "")
                  for tool in request.tools or ())
    parallel = request.parallel_tool_calls if request.parallel_tool_calls is not None else True
    return ToolsRequest(tools, mode, named, parallel)


def _structured(request: ResponsesRequest) -> StructuredOutput | None:
    fmt = request.text.format if request.text is not None else None
    if isinstance(fmt, ResponsesTextFormatJsonObject):
        return StructuredOutput(JsonObject(), "text.format")
    if isinstance(fmt, ResponsesTextFormatJsonSchema):
        return StructuredOutput(JsonSchema(fmt.schema, bool(fmt.strict)), "text.format.schema")
    return None


def output_message(choices: ChatChoices, index: int) -> dict[str, Any]:
    """The choice as the assistant message that continues the conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": choices.content(index)}
    calls = choices.tool_calls(index)
    if calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
    reasoning = choices.reasoning(index)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
