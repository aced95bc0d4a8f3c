"""Request bodies of the OpenAI-compatible endpoints, validated by msgspec on decode.

Which unknown fields are errors, deliberately:
- The top level of chat/completions requests forbids unknown fields, as OpenAI does: a typo
  (`max_token`) or a feature Atlas lacks (`guided_json`, `suffix`) is a 400 naming the field,
  never silently ignored. Every field OpenAI defines is declared, so what official clients send
  (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, ...) is accepted; fields
  that change nothing here are ignored, fields that would change the answer and are not
  supported are rejected with a message (see `unsupported_features`).
- Messages and content parts ignore unknown fields: SDKs echo an assistant message back with
  `refusal`, `annotations`, `audio` and similar keys.

Every number and size is bounded here, so nothing out of range reaches the engine's int32
arrays and no request costs memory or time out of proportion to its size; the bounds come from
`atlas.domain.requests` where the engine enforces them too, and /openapi.json publishes them.
Floats outside their documented range, including 1e999 (out of range for a double), are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from atlas.domain.requests import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
    PENALTY_RANGE,
)

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
MAX_MESSAGES = 8192
MAX_CONTENT_PARTS = 1024  # per message
MAX_TOOLS = 512
MAX_PROMPTS = 256  # prompts in one completions request
MAX_NAME_CHARS = 256  # a tool's or a schema's name
MAX_PATTERN_CHARS = 65_536  # a regex, or one structured-output choice
MAX_CHOICES = 1024  # structured-output choices
MAX_GRAMMAR_CHARS = 1 << 20

Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Priority = Annotated[int, Meta(ge=-INT32_MAX, le=INT32_MAX)]  # vLLM's: any int, lower first
Penalty = Annotated[float, Meta(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Role = Literal["system", "user", "assistant", "tool", "developer"]
ToolName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding field; nothing to obfuscate here
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    content: str | Annotated[list[ContentPart], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # what this server answered (vLLM's name)
    reasoning: str | None = None  # vLLM's newer name for it


# Rules across fields that msgspec does not check (the handlers do), stated in /openapi.json so
# clients and fuzzers generated from it send what the server accepts.
_CONTENT_OR_TOOL_CALLS = {"anyOf": [
    {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
]}
_TOP_LOGPROBS_NEED_LOGPROBS = {"anyOf": [
    {"properties": {"top_logprobs": {"anyOf": [{"type": "null"}, {"const": 0}]}}},
    {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
]}
_PROMPT_XOR_MESSAGES = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
]}

Messages = Annotated[
    list[Annotated[ChatMessage, Meta(extra_json_schema=_CONTENT_OR_TOOL_CALLS)]],
    Meta(min_length=1, max_length=MAX_MESSAGES),
]


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object; absent: no arguments
    strict: bool | None = None  # the arguments always follow the schema when a grammar forces the call


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: ToolName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaDefinition(msgspec.Struct, kw_only=True):
    name: ToolName
    description: str | None = None
    schema: dict[str, Any] | None = None  # absent: any JSON value
    strict: bool | None = None  # schema keywords the grammar cannot enforce are a 400 instead of ignored


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    json_schema: JsonSchemaDefinition


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these constrains the answer."""

    json: dict[str, Any] | str | None = None  # a JSON Schema, as an object or as its JSON text
    regex: Annotated[str, Meta(min_length=1, max_length=MAX_PATTERN_CHARS)] | None = None
    choice: Annotated[list[Annotated[str, Meta(max_length=MAX_PATTERN_CHARS)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None  # Lark or GBNF
    json_object: bool | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and completions: OpenAI's, then the extensions vLLM users send."""

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: Annotated[
        dict[str, Annotated[float, Meta(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
        Meta(max_length=MAX_LOGIT_BIAS_ENTRIES),
    ] | None = None
    max_tokens: TokenCount | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    seed: int | None = None  # SamplingParams bounds it to 64 bits (msgspec bounds stop at int64)
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: Priority | None = None  # lower runs first under --scheduling-policy priority


class ChatCompletionRequest(_SamplingFields, forbid_unknown_fields=True, kw_only=True):
    messages: Messages
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None  # a latency hint; the answer is the same without it
    reasoning_effort: ReasoningEffort | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: str | None = None
    # extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    structured_outputs: StructuredOutputs | None = None
    thinking_token_budget: Count | None = None


# A prompt is str | list[str] | list[int] | list[list[int]]; msgspec unions allow one array type,
# so the list is decoded as `list[Any]`, checked by `completion_prompts`, and described to
# /openapi.json by this schema.
PROMPT_LIST_SCHEMA = {"anyOf": [
    {"items": {"type": "string"}, "maxItems": MAX_PROMPTS},
    {"items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}},
    {"items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}, "minItems": 1},
     "maxItems": MAX_PROMPTS},
]}


class CompletionRequest(_SamplingFields, forbid_unknown_fields=True, kw_only=True):
    prompt: str | Annotated[list[Any], Meta(min_length=1, extra_json_schema=PROMPT_LIST_SCHEMA)]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# The bodies as /openapi.json describes them: cross-field rules, and examples (a streamed one
# among them) that clients and fuzzers can start from.
_HELLO = [{"role": "user", "content": "Say hello."}]
ChatCompletionBody = Annotated[ChatCompletionRequest, Meta(
    extra_json_schema=_TOP_LOGPROBS_NEED_LOGPROBS,
    examples=[{"messages": _HELLO, "max_tokens": 8},
              {"messages": _HELLO, "max_tokens": 8, "n": 2, "stream": True, "logprobs": True, "top_logprobs": 2,
               "stream_options": {"include_usage": True}}],
)]
CompletionBody = Annotated[CompletionRequest, Meta(
    examples=[{"prompt": "Once upon a time", "max_tokens": 8},
              {"prompt": ["Once", "Twice"], "max_tokens": 8, "stream": True, "logprobs": 2, "echo": False}],
)]
TokenizeBody = Annotated[TokenizeRequest, Meta(
    extra_json_schema=_PROMPT_XOR_MESSAGES,
    examples=[{"prompt": "Hello world", "return_token_strs": True}, {"messages": _HELLO}],
)]


def unsupported_features(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(field, why) for a feature that would change the answer and Atlas does not implement."""
    if isinstance(request, ChatCompletionRequest):
        if request.modalities and any(m != "text" for m in request.modalities):
            return "modalities", "only text output is supported"
        return None
    if request.suffix:
        return "suffix", "suffix (insertion) is not supported"
    if request.echo and request.logprobs is not None:
        return "echo", "echo with logprobs needs prompt logprobs, which are not supported"
    n = request.n if request.n is not None else 1
    if request.best_of is not None and request.best_of != n:
        return "best_of", "best_of must equal n (best-of selection is not supported)"
    return None
