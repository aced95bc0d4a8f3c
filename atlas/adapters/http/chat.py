"""POST /v1/chat/completions: render the chat template, generate, answer in one body or as SSE.

The body becomes a `ChatTurn` (`chat_request`), prepared once (`chat_turn.prepare_turn`:
tools, structured output, reasoning, prompt); each choice's text is read back into
reasoning, content and tool calls (`chat_choices`).

A stream is: one role chunk per choice, delta chunks (several tokens merged when the client
reads slower than the engine produces) carrying `reasoning_content` and `reasoning`, `content`,
or `tool_calls` pieces (a call's id, type and name in its first piece, then its arguments in
pieces), exactly one chunk with `finish_reason` per choice (`tool_calls` when it called tools),
the usage chunk with `choices: []` when `stream_options.include_usage`, then `data: [DONE]`.
Every chunk carries the same `id`, `created` and `model`.
"""

from __future__ import annotations

import random
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from quart import Response

from atlas.adapters.http import sse
from atlas.adapters.http.chat_choices import ChatChoices, ChoiceParts
from atlas.adapters.http.chat_request import chat_turn
from atlas.adapters.http.chat_turn import prepare_turn
from atlas.adapters.http.choices import ChoiceResults, collect
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.generation import Generation
from atlas.adapters.http.params import check_choices, sampling_params
from atlas.adapters.http.responses import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCall,
    FunctionDelta,
    TokenTexts,
    PromptTokensDetails,
    ToolCallChunk,
    ToolCallOut,
    Usage,
)
from atlas.adapters.http.schemas import ChatCompletionRequest, unsupported_features
from atlas.adapters.http.state import ServerState, decode_body, now_s

JSON = "application/json"


@dataclass(frozen=True, slots=True)
class _Reply:
    id: str
    created: int
    model: str

    def chunk(self, choice: ChatChunkChoice, usage: Usage | None = None) -> bytes:
        return sse.event(ChatChunk(self.id, self.created, self.model, [choice], usage=usage))

    def content_chunks(self, index: int) -> sse.TextFrames:
        """`chunk`s of choice `index` whose delta is content alone (no logprobs, finish or
        usage): most of a stream."""
        return sse.TextFrames(lambda text: self.chunk(ChatChunkChoice(index, ChatDelta(content=text))))


async def chat_completions(state: ServerState, body: bytes) -> Response:
    """Answer one chat completion request; raises ApiError for anything the client got wrong."""
    started_s = time.monotonic()
    request = decode_body(body, ChatCompletionRequest)
    model, engine = state.ready(request.model)
    token_texts = state.token_texts
    unsupported = unsupported_features(request)
    if unsupported is not None:
        raise bad_request(*unsupported)
    check_choices(1, request.n, state.config.max_choices_per_request)
    turn = await prepare_turn(model, chat_turn(request))
    params = turn.sampling(sampling_params(request, len(turn.prompt_ids), model.max_model_len, model.vocab_size,
                                           model.sampling_defaults))
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", now_s(), model.name)
    generation = Generation(engine, model.tokenizer, reply.id, [turn.prompt_ids], params, state.seeds, state.metrics,
                            state.in_flight, state.config.request_timeout_s, priority=request.priority or 0,
                            constraint=turn.constraint)
    results = ChoiceResults(generation.num_choices, params.logprobs is not None)
    parsed = ChatChoices(generation.num_choices, turn.reading, random.Random(secrets.randbits(64)))
    if request.stream:
        options = request.stream_options
        frames = _stream(state, generation, reply, results, parsed, token_texts, body, started_s,
                         include_usage=bool(options and options.include_usage),
                         continuous_usage=bool(options and options.continuous_usage_stats))
        return Response(sse.with_errors(frames), 200, sse.HEADERS)
    await collect(generation, results, parsed.apply)
    answer = _completion(reply, generation, results, parsed, token_texts)
    if state.dump is not None:
        state.dump.write("chat", 200, False, started_s, body, answer)
    return Response(sse.encode_json(answer), 200, content_type=JSON)


def _usage(generation: Generation) -> Usage:
    prompt, completion = generation.num_prompt_tokens, generation.num_output_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(generation.num_cached_tokens))


def _message(parsed: ChatChoices, index: int) -> ChatMessageOut:
    calls = [ToolCallOut(call.id, FunctionCall(call.name, call.arguments)) for call in parsed.tool_calls(index)]
    content = parsed.content(index)
    message = ChatMessageOut("assistant", None if calls and not content else content)
    if calls:
        message.tool_calls = calls
    reasoning = parsed.reasoning(index)
    if reasoning is not None:
        message.reasoning_content = message.reasoning = reasoning
    return message


def _completion(
    reply: _Reply, generation: Generation, results: ChoiceResults, parsed: ChatChoices, token_texts: TokenTexts
) -> ChatCompletion:
    choices = []
    for index in range(results.num_choices):
        logprobs = None
        if results.logprobs is not None:
            logprobs = ChatLogprobs(token_texts.chat(tuple(results.logprobs[index])))
        choices.append(ChatChoice(index, _message(parsed, index), logprobs, parsed.openai_finish_reason(index),
                                  results.stop_reasons[index]))
    return ChatCompletion(reply.id, reply.created, reply.model, choices, _usage(generation))


def _delta(parts: ChoiceParts) -> ChatDelta:
    """The chunk's delta; `content: ""` when a chunk carries nothing else (logprobs, a finish)."""
    calls = [ToolCallChunk(call.index, FunctionDelta(call.name, call.arguments), call.id,
                           "function" if call.id is not None else None) for call in parts.tool_calls]
    reasoning = parts.reasoning or None
    content = parts.content if parts.content or (not reasoning and not calls) else None
    return ChatDelta(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls or None)


async def _stream(
    state: ServerState,
    generation: Generation,
    reply: _Reply,
    results: ChoiceResults,
    parsed: ChatChoices,
    token_texts: TokenTexts,
    body: bytes,
    started_s: float,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncGenerator[bytes, None]:
    with_logprobs = results.logprobs is not None
    recording = state.dump is not None  # the dump records the whole answer; the stream needs no copy
    content_chunks = [reply.content_chunks(index) for index in range(generation.num_choices)]
    try:
        yield b"".join(
            sse.event(ChatChunk(reply.id, reply.created, reply.model,
                                [ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
            for index in range(generation.num_choices)
        )
        last: list[bytes] = []
        async with aclosing(generation.batches()) as batches:
            async for batch in batches:
                frames = []
                usage = _usage(generation) if continuous_usage else None
                for update in batch:
                    if recording:
                        results.add(update)
                    parts = parsed.apply(update)
                    if parts.is_empty and update.finish_reason is None and not (with_logprobs and update.logprobs):
                        continue  # text held back (a tag not yet complete)
                    if (parts.content and not (parts.reasoning or parts.tool_calls or update.finish_reason)
                            and not with_logprobs and usage is None):
                        frames.append(content_chunks[update.index](parts.content))
                        continue
                    logprobs = ChatLogprobs(token_texts.chat(update.logprobs)) if with_logprobs else None
                    finish = parsed.openai_finish_reason(update.index) if update.finish_reason is not None else None
                    choice = ChatChunkChoice(update.index, _delta(parts), logprobs, finish, update.stop_reason)
                    frames.append(reply.chunk(choice, usage))
                if frames and generation.is_finished:
                    last = frames  # goes out with the usage chunk and [DONE], one write for all
                elif frames:
                    yield b"".join(frames)
        if include_usage:
            last.append(sse.event(ChatChunk(reply.id, reply.created, reply.model, [], usage=_usage(generation))))
        yield b"".join([*last, sse.DONE])
    finally:
        if state.dump is not None:
            state.dump.write("chat", 200, True, started_s, body,
                             _completion(reply, generation, results, parsed, token_texts))
