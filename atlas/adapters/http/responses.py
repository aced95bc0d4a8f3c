"""Response bodies of the OpenAI-compatible endpoints, as msgspec Structs (encoded once each).

Fields OpenAI always sends are always present (`finish_reason: null`, `logprobs: null`); a
streamed `delta` omits what it does not carry, as OpenAI's does, and a message without tool
calls has no `tool_calls` field (an empty list trips clients that test for the key).
`stop_reason` is vLLM's extension: the stop string or stop token id that ended a choice;
`reasoning_content` (and `reasoning`, its newer name) is vLLM's for a reasoning model's block.
"""

from __future__ import annotations

import msgspec

from atlas.domain.batch import TokenLogprobs
from atlas.ports.tokenizer import Tokenizer


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # the JSON text of the arguments object


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None  # null when the message is only tool calls
    refusal: None = None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET  # absent from a reply without tool calls
    # The reasoning block of a reasoning model (vLLM's two names); absent when there is none.
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """A piece of call `index`: `id`, `type` and the function's name in its first piece only."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class TokenTexts:
    """Each token id's text and UTF-8 bytes as logprobs report them, decoded once and kept.

    A byte-level token that is part of a multi-byte character decodes to U+FFFD on its own;
    its `bytes` are then those of the replacement character, as other servers report them.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._texts.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            entry = self._texts[token_id] = (text, list(text.encode("utf-8", "replace")))
        return entry

    def chat(self, logprobs: tuple[TokenLogprobs, ...]) -> list[TokenLogprob]:
        items = []
        for entry in logprobs:
            text, raw = self.get(entry.token_id)
            tops = []
            for token_id, value in entry.top:
                top_text, top_raw = self.get(token_id)
                tops.append(TopLogprob(top_text, value, top_raw))
            items.append(TokenLogprob(text, entry.logprob, raw, tops))
        return items

    def completion(self, logprobs: tuple[TokenLogprobs, ...], text_offset_start: int) -> CompletionLogprobs:
        """The legacy completions shape; offsets count characters from `text_offset_start`."""
        tokens, values, tops, offsets = [], [], [], []
        offset = text_offset_start
        for entry in logprobs:
            text, _ = self.get(entry.token_id)
            tokens.append(text)
            values.append(entry.logprob)
            tops.append({self.get(token_id)[0]: value for token_id, value in entry.top})
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens, values, tops, offsets)
