"""From an OpenAI chat completions body to a `ChatTurn`: tools, structured output, thinking budget.

    tools + tool_choice + parallel_tool_calls        -> ToolsRequest
    response_format json_object / json_schema        -> StructuredOutput (or structured_outputs:
                                                        json, regex, choice, grammar, json_object)
    thinking_token_budget, else reasoning_effort     -> ThinkingBudget
"""

from __future__ import annotations

import json
from typing import Any

from atlas.adapters.http.chat_turn import ChatTurn, StructuredOutput, ThinkingBudget, ToolChoice, ToolsRequest
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.prompts import message_dicts
from atlas.adapters.http.schemas import (
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    StructuredOutputs,
)
from atlas.domain.reasoning_budget import REASONING_EFFORT_BUDGETS
from atlas.ports.grammar import Choice, FunctionTool, Grammar, JsonObject, JsonSchema, Regex


def chat_turn(request: ChatCompletionRequest) -> ChatTurn:
    """The turn `request` asks for; 400 naming the field for contradicting structured-output fields."""
    return ChatTurn(
        messages=message_dicts(request.messages),
        tools=tools_request(request),
        structured=structured_output(request),
        thinking_budget=thinking_budget(request),
        template_kwargs=dict(request.chat_template_kwargs or {}),
        add_generation_prompt=request.add_generation_prompt,
    )


def tools_request(request: ChatCompletionRequest) -> ToolsRequest | None:
    choice = request.tool_choice
    if not request.tools:
        if choice is None or choice in ("none", "auto"):
            return None
        return ToolsRequest((), _choice(choice), _named(choice))
    tools = tuple(FunctionTool(tool.function.name, dict(tool.function.parameters or {}),
                               tool.function.description or "") for tool in request.tools)
    parallel = request.parallel_tool_calls if request.parallel_tool_calls is not None else True
    return ToolsRequest(tools, _choice(choice if choice is not None else "auto"), _named(choice), parallel)


def _choice(choice: str | NamedToolChoice) -> ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return ToolChoice.NAMED
    return ToolChoice(choice)


def _named(choice: str | NamedToolChoice | None) -> str | None:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


def structured_output(request: ChatCompletionRequest) -> StructuredOutput | None:
    from_format = _response_format(request)
    from_vllm = _structured_outputs(request.structured_outputs) if request.structured_outputs is not None else None
    if from_format is not None and from_vllm is not None:
        raise bad_request("structured_outputs", "send response_format or structured_outputs, not both")
    return from_format or from_vllm


def _response_format(request: ChatCompletionRequest) -> StructuredOutput | None:
    fmt = request.response_format
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput(JsonObject(), "response_format")
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema if fmt.json_schema.schema is not None else {}
        return StructuredOutput(JsonSchema(schema, bool(fmt.json_schema.strict)), "response_format.json_schema.schema")
    return None


def _structured_outputs(outputs: StructuredOutputs) -> StructuredOutput:
    fields = {"json": outputs.json, "regex": outputs.regex, "choice": outputs.choice, "grammar": outputs.grammar,
              "json_object": outputs.json_object or None}
    given = [name for name, value in fields.items() if value is not None]
    if len(given) != 1:
        got = f" (got {', '.join(given)})" if given else ""
        raise bad_request("structured_outputs", f"structured_outputs takes exactly one of json, regex, choice, "
                                                f"grammar, json_object{got}")
    field = f"structured_outputs.{given[0]}"
    if outputs.json is not None:
        return StructuredOutput(JsonSchema(_schema_object(outputs.json, field)), field)
    if outputs.regex is not None:
        return StructuredOutput(Regex(outputs.regex), field)
    if outputs.choice is not None:
        return StructuredOutput(Choice(tuple(outputs.choice)), field)
    if outputs.grammar is not None:
        return StructuredOutput(Grammar(outputs.grammar), field)
    return StructuredOutput(JsonObject(), field)


def _schema_object(schema: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(schema, dict):
        return schema
    try:
        decoded = json.loads(schema)
    except (ValueError, RecursionError):
        raise bad_request(field, f"{field} is a string but not JSON; send the schema as an object") from None
    if not isinstance(decoded, dict):
        raise bad_request(field, f"{field} must be a JSON Schema object")
    return decoded


def thinking_budget(request: ChatCompletionRequest) -> ThinkingBudget | None:
    """thinking_token_budget, else the budget reasoning_effort maps to (see docs/api.md)."""
    if request.thinking_token_budget is not None:
        return ThinkingBudget(request.thinking_token_budget, "thinking_token_budget")
    if request.reasoning_effort is not None:
        return ThinkingBudget(REASONING_EFFORT_BUDGETS[request.reasoning_effort], "reasoning_effort")
    return None
