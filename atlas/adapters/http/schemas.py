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

Integers are bounded here so nothing out of range reaches the engine's int32/int64 arrays.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

INT32_MAX = 2**31 - 1
Count = Annotated[int, Meta(ge=-INT32_MAX, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=-INT32_MAX, le=INT32_MAX)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding field; nothing to obfuscate here
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and completions: OpenAI's, then the extensions vLLM users send."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: Count | None = None
    n: Count | None = None
    seed: int | None = None  # SamplingParams bounds it to 64 bits (msgspec bounds stop at int64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: Count | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: Count | None = None  # lower runs first under --scheduling-policy priority


class ChatCompletionRequest(_SamplingFields, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Count | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None  # a latency hint; the answer is the same without it
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: str | None = None
    # extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_SamplingFields, forbid_unknown_fields=True, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec unions allow one array type, so the
    # list forms are checked by `completion_prompts`
    prompt: str | list[Any]
    logprobs: Count | None = None
    echo: bool | None = False
    best_of: Count | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


def unsupported_features(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(field, why) for a feature that would change the answer and Atlas does not implement."""
    if isinstance(request, ChatCompletionRequest):
        if request.response_format is not None and request.response_format.type != "text":
            return "response_format", f"response_format type '{request.response_format.type}' is not supported"
        if request.modalities and any(m != "text" for m in request.modalities):
            return "modalities", "only text output is supported"
        if isinstance(request.tool_choice, dict) or request.tool_choice == "required":
            return "tool_choice", "forcing a tool call is not supported; use 'auto' or 'none'"
        return None
    if request.suffix:
        return "suffix", "suffix (insertion) is not supported"
    if request.echo and request.logprobs is not None:
        return "echo", "echo with logprobs needs prompt logprobs, which are not supported"
    n = request.n if request.n is not None else 1
    if request.best_of is not None and request.best_of != n:
        return "best_of", "best_of must equal n (best-of selection is not supported)"
    return None
