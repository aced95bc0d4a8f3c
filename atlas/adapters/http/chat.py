"""POST /v1/chat/completions: render the chat template, generate, answer in one body or as SSE.

A stream is: one role chunk per choice, content chunks (several tokens merged when the client
reads slower than the engine produces), exactly one chunk with `finish_reason` per choice, the
usage chunk with `choices: []` when `stream_options.include_usage`, then `data: [DONE]`. Every
chunk carries the same `id`, `created` and `model`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from quart import Response

from atlas.adapters.http import sse
from atlas.adapters.http.choices import ChoiceResults, collect, merge_batch
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.generation import Generation
from atlas.adapters.http.params import check_choices, check_prompt_fits, sampling_params
from atlas.adapters.http.prompts import render_chat, tokenize
from atlas.adapters.http.responses import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    TokenTexts,
    PromptTokensDetails,
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
    prompt = await render_chat(model.tokenizer, request.messages, request.tools, request.add_generation_prompt,
                         request.chat_template_kwargs)
    prompt_ids = await tokenize(model.tokenizer, prompt, add_special_tokens=False)
    if not prompt_ids:
        raise bad_request("messages", "the rendered prompt is empty")
    check_prompt_fits(len(prompt_ids), model.max_model_len, "messages")
    params = sampling_params(request, len(prompt_ids), model.max_model_len, model.vocab_size,
                             model.sampling_defaults)
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", now_s(), model.name)
    generation = Generation(engine, model.tokenizer, reply.id, [prompt_ids], params, state.seeds, state.metrics,
                            state.in_flight, state.config.request_timeout_s, priority=request.priority or 0)
    results = ChoiceResults(generation.num_choices, params.logprobs is not None)
    if request.stream:
        options = request.stream_options
        frames = _stream(state, generation, reply, results, token_texts, body, started_s,
                         include_usage=bool(options and options.include_usage),
                         continuous_usage=bool(options and options.continuous_usage_stats))
        return Response(sse.with_errors(frames), 200, sse.HEADERS)
    await collect(generation, results)
    answer = _completion(reply, generation, results, token_texts)
    if state.dump is not None:
        state.dump.write("chat", 200, False, started_s, body, answer)
    return Response(sse.encode_json(answer), 200, content_type=JSON)


def _usage(generation: Generation) -> Usage:
    prompt, completion = generation.num_prompt_tokens, generation.num_output_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(generation.num_cached_tokens))


def _completion(
    reply: _Reply, generation: Generation, results: ChoiceResults, token_texts: TokenTexts
) -> ChatCompletion:
    choices = []
    for index in range(results.num_choices):
        logprobs = None
        if results.logprobs is not None:
            logprobs = ChatLogprobs(token_texts.chat(tuple(results.logprobs[index])))
        choices.append(ChatChoice(index, ChatMessageOut("assistant", results.text(index)), logprobs,
                                  results.finish_reasons[index], results.stop_reasons[index]))
    return ChatCompletion(reply.id, reply.created, reply.model, choices, _usage(generation))


async def _stream(
    state: ServerState,
    generation: Generation,
    reply: _Reply,
    results: ChoiceResults,
    token_texts: TokenTexts,
    body: bytes,
    started_s: float,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncGenerator[bytes, None]:
    with_logprobs = results.logprobs is not None
    try:
        yield b"".join(
            sse.event(ChatChunk(reply.id, reply.created, reply.model,
                                [ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))
            for index in range(generation.num_choices)
        )
        async with aclosing(generation.batches()) as batches:
            async for batch in batches:
                frames = []
                usage = _usage(generation) if continuous_usage else None
                for update in merge_batch(batch):
                    results.add(update)
                    logprobs = ChatLogprobs(token_texts.chat(update.logprobs)) if with_logprobs else None
                    choice = ChatChunkChoice(update.index, ChatDelta(content=update.text), logprobs,
                                             update.finish_reason, update.stop_reason)
                    frames.append(sse.event(ChatChunk(reply.id, reply.created, reply.model, [choice], usage=usage)))
                if frames:
                    yield b"".join(frames)
        if include_usage:
            yield sse.event(ChatChunk(reply.id, reply.created, reply.model, [], usage=_usage(generation)))
        yield sse.DONE
    finally:
        if state.dump is not None:
            state.dump.write("chat", 200, True, started_s, body, _completion(reply, generation, results, token_texts))
