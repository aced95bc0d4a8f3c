"""OpenAI Responses API bodies (POST /v1/responses, GET and DELETE /v1/responses/{id}).

As for chat completions (`schemas`): the top level forbids unknown fields, every field OpenAI
defines is declared (ignored when it changes nothing here, rejected by
`unsupported_responses_features` when it would change the answer), and every number and size
is bounded.

An input item is one Struct with every item type's fields, `type` defaulting to "message":
OpenAI's SDKs send messages without a type (`{"role": "user", "content": "hi"}`), which a
tagged union cannot decode. `responses_items` checks each item's fields by its type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from atlas.adapters.http.schemas import (
    INT32_MAX,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TEMPERATURE,
    MAX_TOOLS,
    ReasoningEffort,
    TokenCount,
    ToolName,
)

MAX_METADATA_ENTRIES = 16  # OpenAI's bound
MAX_RESPONSE_ID_CHARS = 256

# -- request --------------------------------------------------------------------------------


class InputContent(msgspec.Struct, kw_only=True):
    """A content part: input_text / output_text / text, refusal, reasoning_text, summary_text;
    input_image, input_file and input_audio are declared to get a clear 400."""

    type: Literal["input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text", "input_image",
                  "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None


InputContents = Annotated[list[InputContent], Meta(max_length=MAX_CONTENT_PARTS)]


class InputItem(msgspec.Struct, kw_only=True):
    type: Literal["message", "function_call", "function_call_output", "reasoning", "item_reference"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None  # message
    content: str | InputContents | None = None  # message; reasoning (reasoning_text parts)
    id: str | None = None
    status: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: the JSON text
    output: str | InputContents | None = None  # function_call_output
    summary: InputContents | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning: another server's; ignored


class ResponsesFunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]  # OpenAI's hosted tools (web_search, file_search, ...) are a 400
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: ToolName


class ResponsesTextFormatText(msgspec.Struct, tag_field="type", tag="text"):
    pass


class ResponsesTextFormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class ResponsesTextFormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    name: ToolName
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


ResponsesTextFormat = ResponsesTextFormatText | ResponsesTextFormatJsonObject | ResponsesTextFormatJsonSchema


class ResponsesTextOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # ignored: the model decides its length


class ResponsesReasoningOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # ignored: the reasoning is returned whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its older name


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


ResponseId = Annotated[str, Meta(min_length=1, max_length=MAX_RESPONSE_ID_CHARS)]


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], Meta(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: Annotated[list[ResponsesFunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: TokenCount | None = None
    max_tool_calls: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None  # rejected: not enforced
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # rejected above 0
    text: ResponsesTextOptions | None = None
    reasoning: ResponsesReasoningOptions | None = None
    store: bool | None = None  # default true, as OpenAI's
    previous_response_id: ResponseId | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA_ENTRIES)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # ignored: reasoning text is always included
    background: bool | None = None  # rejected when true
    prompt: dict[str, Any] | None = None  # rejected: no stored prompt templates
    conversation: str | dict[str, Any] | None = None  # rejected: no conversations API


_HELLO = [{"role": "user", "content": "Say hello."}]
ResponsesBody = Annotated[ResponsesRequest, Meta(examples=[
    {"input": "Say hello.", "max_output_tokens": 8},
    {"input": _HELLO, "max_output_tokens": 8, "stream": True, "instructions": "Be brief.", "store": False},
])]


def unsupported_responses_features(request: ResponsesRequest) -> tuple[str, str] | None:
    """(field, why) for a field that would change the answer and Atlas does not implement."""
    if request.background:
        return "background", "background responses are not supported; send the request and wait, or stream it"
    if request.prompt is not None:
        return "prompt", "stored prompt templates are not supported; send the input itself"
    if request.conversation is not None:
        return "conversation", "the conversations API is not supported; use previous_response_id"
    if request.max_tool_calls is not None:
        return "max_tool_calls", "max_tool_calls is not supported"
    if request.top_logprobs:
        return "top_logprobs", "logprobs are not supported on /v1/responses; use /v1/chat/completions"
    return None


# -- response -------------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponsesUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesReasoningOut(msgspec.Struct, frozen=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesTextOut(msgspec.Struct, frozen=True):
    format: dict[str, Any]


Status = Literal["completed", "incomplete", "in_progress", "cancelled", "failed"]


class ResponseError(msgspec.Struct, frozen=True):
    """Why a response failed (status "failed"): the error object's code, or its type, and message."""

    code: str
    message: str


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: Status
    usage: ResponsesUsage | None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ResponsesReasoningOut = ResponsesReasoningOut()
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: ResponsesTextOut = ResponsesTextOut({"type": "text"})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    truncation: str = "disabled"
    user: str | None = None
    background: bool = False
    error: ResponseError | None = None
    object: str = "response"


class ResponseDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response"


# -- stream events (each carries its place in the stream, `sequence_number`) ---------------


class ResponseCreated(msgspec.Struct, tag_field="type", tag="response.created"):
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(msgspec.Struct, tag_field="type", tag="response.in_progress"):
    sequence_number: int
    response: ResponseObject


class ResponseCompleted(msgspec.Struct, tag_field="type", tag="response.completed"):
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(msgspec.Struct, tag_field="type", tag="response.incomplete"):
    sequence_number: int
    response: ResponseObject


class ResponseFailed(msgspec.Struct, tag_field="type", tag="response.failed"):
    sequence_number: int
    response: ResponseObject


class OutputItemAdded(msgspec.Struct, tag_field="type", tag="response.output_item.added"):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(msgspec.Struct, tag_field="type", tag="response.output_item.done"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(msgspec.Struct, tag_field="type", tag="response.content_part.added"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(msgspec.Struct, tag_field="type", tag="response.content_part.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(msgspec.Struct, tag_field="type", tag="error"):
    sequence_number: int
    message: str
    code: str | None = None
    param: str | None = None


ResponsesStreamEvent = (ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | ResponseFailed
                        | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta
                        | OutputTextDone | ReasoningTextDelta | ReasoningTextDone | FunctionCallArgumentsDelta
                        | FunctionCallArgumentsDone | ResponseErrorEvent)
