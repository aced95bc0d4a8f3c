"""POST /v1/completions: prompts as text, lists of text or token ids; `echo`; stream or not.

With several prompts and `n` choices each, choice `index` is `prompt_idx * n + choice_idx`.
A stream sends one chunk per choice update, exactly one carrying each choice's
`finish_reason`, the usage chunk with `choices: []` when asked, then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from quart import Response

from atlas.adapters.http import sse
from atlas.adapters.http.choices import ChoiceResults, collect
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.generation import Generation
from atlas.adapters.http.params import check_choices, check_prompt_fits, sampling_params
from atlas.adapters.http.prompts import completion_prompts, count_prompts
from atlas.adapters.http.responses import (
    Completion,
    CompletionChoice,
    TokenTexts,
    PromptTokensDetails,
    Usage,
)
from atlas.adapters.http.schemas import CompletionRequest, unsupported_features
from atlas.adapters.http.state import ServerState, decode_body, now_s

JSON = "application/json"


class _Reply:
    __slots__ = ("id", "created", "model", "echo_texts", "n")

    def __init__(self, model: str, echo_texts: list[str], n: int) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = now_s()
        self.model = model
        self.echo_texts = echo_texts  # per prompt; empty strings without echo
        self.n = n

    def echo(self, index: int) -> str:
        return self.echo_texts[index // self.n]

    def chunk(self, choice: CompletionChoice) -> bytes:
        return sse.event(Completion(self.id, self.created, self.model, [choice], None))

    def text_chunks(self, index: int) -> sse.TextFrames:
        """`chunk`s of choice `index` carrying only text (no logprobs, no finish): most of a stream."""
        return sse.TextFrames(lambda text: self.chunk(CompletionChoice(index, text, None, None)))


async def completions(state: ServerState, body: bytes) -> Response:
    """Answer one completions request; raises ApiError for anything the client got wrong."""
    started_s = time.monotonic()
    request = decode_body(body, CompletionRequest)
    model, engine = state.ready(request.model)
    token_texts = state.token_texts
    unsupported = unsupported_features(request)
    if unsupported is not None:
        raise bad_request(*unsupported)
    check_choices(count_prompts(request.prompt), request.n, state.config.max_choices_per_request)
    add_special = request.add_special_tokens if request.add_special_tokens is not None else True
    prompts = await completion_prompts(model.tokenizer, request.prompt, add_special, model.vocab_size)
    for _, ids in prompts:
        if not ids:
            raise bad_request("prompt", "the prompt is empty")
        check_prompt_fits(len(ids), model.max_model_len, "prompt")
    params = sampling_params(request, max(len(ids) for _, ids in prompts), model.max_model_len, model.vocab_size,
                             model.sampling_defaults)
    echo_texts = [
        (text if text is not None else model.tokenizer.decode(ids, skip_special_tokens=False)) if request.echo else ""
        for text, ids in prompts
    ]
    reply = _Reply(model.name, echo_texts, params.n)
    generation = Generation(engine, model.tokenizer, reply.id, [ids for _, ids in prompts], params, state.seeds,
                            state.metrics, state.in_flight, state.config.request_timeout_s,
                            priority=request.priority or 0)
    results = ChoiceResults(generation.num_choices, params.logprobs is not None)
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        frames = _stream(state, generation, reply, results, token_texts, body, started_s, include_usage)
        return Response(sse.with_errors(frames), 200, sse.HEADERS)
    await collect(generation, results)
    answer = _completion(reply, generation, results, token_texts)
    if state.dump is not None:
        state.dump.write("completions", 200, False, started_s, body, answer)
    return Response(sse.encode_json(answer), 200, content_type=JSON)


def _usage(generation: Generation) -> Usage:
    prompt, completion = generation.num_prompt_tokens, generation.num_output_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(generation.num_cached_tokens))


def _completion(reply: _Reply, generation: Generation, results: ChoiceResults, token_texts: TokenTexts) -> Completion:
    choices = []
    for index in range(results.num_choices):
        echo = reply.echo(index)
        logprobs = None
        if results.logprobs is not None:
            logprobs = token_texts.completion(tuple(results.logprobs[index]), len(echo))
        choices.append(CompletionChoice(index, echo + results.text(index), logprobs, results.finish_reasons[index],
                                        results.stop_reasons[index]))
    return Completion(reply.id, reply.created, reply.model, choices, _usage(generation))


async def _stream(
    state: ServerState,
    generation: Generation,
    reply: _Reply,
    results: ChoiceResults,
    token_texts: TokenTexts,
    body: bytes,
    started_s: float,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    with_logprobs = results.logprobs is not None
    recording = state.dump is not None  # the dump records the whole answer; the stream needs no copy
    offsets = [len(reply.echo(index)) for index in range(generation.num_choices)]
    text_chunks = [reply.text_chunks(index) for index in range(generation.num_choices)]
    try:
        echoes = [text_chunks[index](reply.echo(index)) for index in range(generation.num_choices)
                  if reply.echo(index)]
        if echoes:
            yield b"".join(echoes)
        last: list[bytes] = []
        async with aclosing(generation.batches()) as batches:
            async for batch in batches:
                frames = []
                for update in batch:
                    if recording:
                        results.add(update)
                    if not with_logprobs and update.finish_reason is None:
                        frames.append(text_chunks[update.index](update.text))
                        continue
                    logprobs = None
                    if with_logprobs:
                        logprobs = token_texts.completion(update.logprobs, offsets[update.index])
                        offsets[update.index] += sum(len(t) for t in logprobs.tokens)
                    frames.append(reply.chunk(CompletionChoice(update.index, update.text, logprobs,
                                                               update.finish_reason, update.stop_reason)))
                if frames and generation.is_finished:
                    last = frames  # goes out with the usage chunk and [DONE], one write for all
                elif frames:
                    yield b"".join(frames)
        if include_usage:
            last.append(sse.event(Completion(reply.id, reply.created, reply.model, [], _usage(generation))))
        yield b"".join([*last, sse.DONE])
    finally:
        if state.dump is not None:
            state.dump.write("completions", 200, True, started_s, body,
                             _completion(reply, generation, results, token_texts))
