"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

The body becomes a `ChatTurn` (`responses_items`) and runs as one chat choice. With `store`
(the default) the response and its conversation go to the bounded `ResponseStore`, so a later
request's `previous_response_id` continues it and GET returns it. A stream is the event
sequence the openai SDK assembles:

    response.created  response.in_progress
    output_item.added(reasoning)  reasoning_text.delta...  reasoning_text.done  output_item.done
    output_item.added(message)  content_part.added  output_text.delta...  output_text.done
        content_part.done  output_item.done
    output_item.added(function_call)  function_call_arguments.delta...  function_call_arguments.done
        output_item.done
    response.completed (response.incomplete at max_output_tokens)

A failure after the 200 went out (the engine gave up on the request) ends the stream with an
`error` event, then `response.failed` holding the items so far and the error.

Every event carries `sequence_number`; items open as their first piece arrives and close when
the next begins, and the final response lists the same items with the same ids.
"""

from __future__ import annotations

import functools
import random
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import msgspec
from quart import Response

from atlas.adapters.http import sse
from atlas.adapters.http.chat_choices import ChatChoices, ChoiceParts
from atlas.adapters.http.chat_turn import prepare_turn
from atlas.adapters.http.choices import ChoiceResults, collect
from atlas.adapters.http.errors import ApiError, bad_request, excerpt
from atlas.adapters.http.generation import Generation
from atlas.adapters.http.params import RequestedSampling, build_sampling_params
from atlas.adapters.http.response_store import StoredResponse
from atlas.adapters.http.responses_api_schemas import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseDeleted,
    ResponseError,
    ResponseErrorEvent,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesReasoningOut,
    ResponsesRequest,
    ResponsesTextOut,
    ResponsesUsage,
    ResponsesTextFormatText,
    unsupported_responses_features,
)
from atlas.adapters.http.responses_items import input_messages, output_message, responses_turn
from atlas.adapters.http.state import ServerState, decode_body, now_s

JSON = "application/json"


async def create_response(state: ServerState, body: bytes) -> Response:
    """Answer one Responses request; raises ApiError for anything the client got wrong."""
    started_s = time.monotonic()
    request = decode_body(body, ResponsesRequest)
    model, engine = state.ready(request.model)
    unsupported = unsupported_responses_features(request)
    if unsupported is not None:
        raise bad_request(*unsupported)
    conversation = _history(state, request.previous_response_id) + input_messages(request.input)
    if all(message["role"] == "system" for message in conversation):
        raise bad_request("input", "input holds no message to answer (reasoning items are context, not a turn); "
                                   "send a message or a function_call_output item")
    turn = await prepare_turn(model, responses_turn(request, conversation))
    requested = RequestedSampling(max_tokens=request.max_output_tokens, max_tokens_field="max_output_tokens",
                                  temperature=request.temperature, top_p=request.top_p)
    params = turn.sampling(build_sampling_params(requested, len(turn.prompt_ids), model.max_model_len,
                                                 model.vocab_size, model.sampling_defaults))
    reply = _Reply(request, model.name, store=request.store is not False and state.responses.enabled)
    generation = Generation(engine, model.tokenizer, reply.id, [turn.prompt_ids], params, state.seeds, state.metrics,
                            state.in_flight, state.config.request_timeout_s, constraint=turn.constraint)
    parsed = ChatChoices(1, turn.reading, random.Random(secrets.randbits(64)))
    items = _Items()
    if request.stream:
        numbered = _Numbered()
        frames = _stream(state, generation, reply, parsed, items, numbered, conversation, body, started_s)
        on_error = functools.partial(_failure_frames, numbered, reply, items)
        return Response(sse.with_errors(frames, on_error), 200, sse.HEADERS)

    def on_update(update) -> None:
        items.events(parsed.apply(update))

    await collect(generation, ChoiceResults(1, False), on_update)
    items.finish()
    answer = reply.finished(generation, parsed, items.output)
    _store(state, reply, answer, conversation, parsed)
    if state.dump is not None:
        state.dump.write("responses", 200, False, started_s, body, answer)
    return Response(sse.encode_json(answer), 200, content_type=JSON)


async def get_response(state: ServerState, response_id: str) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return Response(stored.response_json, 200, content_type=JSON)


async def delete_response(state: ServerState, response_id: str) -> Response:
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return Response(sse.encode_json(ResponseDeleted(response_id)), 200, content_type=JSON)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id {excerpt(response_id)} (responses are kept in memory, the "
                         f"least recently used dropped first: --max-stored-responses)", "invalid_request_error",
                    code="not_found")


def _history(state: ServerState, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None:
        raise bad_request("previous_response_id", f"previous response {excerpt(previous_response_id)} is not "
                                                  f"stored here (it was sent with store: false, dropped from the "
                                                  f"bounded store, or the server restarted)", code="not_found")
    return list(stored.messages)


def _store(state: ServerState, reply: _Reply, answer: ResponseObject, conversation: list[dict[str, Any]],
           parsed: ChatChoices) -> None:
    if reply.store:
        messages = (*conversation, output_message(parsed, 0))
        state.responses.put(reply.id, StoredResponse(sse.encode_json(answer), messages))


class _Reply:
    """The response object's fields that echo the request."""

    def __init__(self, request: ResponsesRequest, model_name: str, store: bool) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = now_s()
        self.model = model_name
        self.store = store
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        choice = request.tool_choice
        self._echo: dict[str, Any] = dict(
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=dict(request.metadata or {}),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            reasoning=ResponsesReasoningOut(request.reasoning.effort if request.reasoning else None),
            store=store,
            temperature=request.temperature,
            top_p=request.top_p,
            text=ResponsesTextOut(msgspec.to_builtins(fmt or ResponsesTextFormatText())),
            tool_choice=msgspec.to_builtins(choice) if choice is not None else "auto",
            tools=msgspec.to_builtins(request.tools or []),
            truncation=request.truncation or "disabled",
            user=request.user,
        )

    def snapshot(self, status: str, output: list[OutputItem], usage: ResponsesUsage | None = None,
                 incomplete: IncompleteDetails | None = None, error: ResponseError | None = None) -> ResponseObject:
        return ResponseObject(self.id, self.created, self.model, output, status, usage, incomplete, error=error,
                              **self._echo)

    def finished(self, generation: Generation, parsed: ChatChoices, output: list[OutputItem]) -> ResponseObject:
        reason = parsed.finish_reason(0)
        status, incomplete = "completed", None
        if reason == "length":
            status, incomplete = "incomplete", IncompleteDetails("max_output_tokens")
        elif reason == "abort":
            status = "cancelled"
        prompt, completion = generation.num_prompt_tokens, generation.num_output_tokens
        cached = InputTokensDetails(generation.num_cached_tokens)
        usage = ResponsesUsage(prompt, completion, prompt + completion, cached,
                               OutputTokensDetails(parsed.num_reasoning_tokens(0)))
        return self.snapshot(status, output, usage, incomplete)


class _Items:
    """The output items of one choice as its parts arrive, and the stream events that build them.

    `events(parts)` returns the (unnumbered) events for new parts; `finish()` closes the open
    item; `output` lists the items so far, each as it is (or was, when it closed).
    """

    def __init__(self) -> None:
        self.output: list[OutputItem] = []
        self._open: tuple[str, int] | None = None  # (kind, call index)
        self._texts: list[str] = []

    def events(self, parts: ChoiceParts) -> list[msgspec.Struct]:
        events: list[msgspec.Struct] = []
        if parts.reasoning:
            events += self._begin(("reasoning", 0), OutputReasoning(new_item_id("rs"), [], status="in_progress"))
            events.append(ReasoningTextDelta(0, self._item.id, self._index, 0, parts.reasoning))
            self._texts.append(parts.reasoning)
        if parts.content:
            events += self._begin(("message", 0), OutputMessage(new_item_id("msg"), [], status="in_progress"))
            events.append(OutputTextDelta(0, self._item.id, self._index, 0, parts.content))
            self._texts.append(parts.content)
        for call in parts.tool_calls:
            if call.id is not None:
                item = OutputFunctionCall(new_item_id("fc"), call.id, call.name or "", "", status="in_progress")
                events += self._begin(("function_call", call.index), item)
            if call.arguments:
                events.append(FunctionCallArgumentsDelta(0, self._item.id, self._index, call.arguments))
                self._texts.append(call.arguments)
        return events

    def finish(self) -> list[msgspec.Struct]:
        """Close the open item; an output with no item at all gets an empty message."""
        events = [] if self.output else self._begin(("message", 0), OutputMessage(new_item_id("msg"), [],
                                                                                   status="in_progress"))
        return events + self._close()

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    @property
    def _item(self) -> OutputItem:
        return self.output[-1]

    def _begin(self, key: tuple[str, int], item: OutputItem) -> list[msgspec.Struct]:
        if self._open == key:
            return []
        events = self._close()
        self._open = key
        self.output.append(item)
        events.append(OutputItemAdded(0, self._index, item))
        if isinstance(item, OutputMessage):
            events.append(ContentPartAdded(0, item.id, self._index, 0, OutputText("")))
        return events

    def _close(self) -> list[msgspec.Struct]:
        if self._open is None:
            return []
        text, item, index = "".join(self._texts), self._item, self._index
        self._texts.clear()
        self._open = None
        events: list[msgspec.Struct] = []
        if isinstance(item, OutputReasoning):
            done: OutputItem = OutputReasoning(item.id, [ReasoningText(text)])
            events.append(ReasoningTextDone(0, item.id, index, 0, text))
        elif isinstance(item, OutputMessage):
            done = OutputMessage(item.id, [OutputText(text)])
            events += [OutputTextDone(0, item.id, index, 0, text),
                       ContentPartDone(0, item.id, index, 0, OutputText(text))]
        else:
            done = OutputFunctionCall(item.id, item.call_id, item.name, text)
            events.append(FunctionCallArgumentsDone(0, item.id, index, item.name, text))
        self.output[index] = done
        return events + [OutputItemDone(0, index, done)]


class _Numbered:
    """Numbers a stream's events (`sequence_number`) and frames them as named SSE events."""

    def __init__(self) -> None:
        self._next = 0

    def frames(self, events: list[msgspec.Struct]) -> bytes:
        frames = []
        for event in events:
            event = msgspec.structs.replace(event, sequence_number=self._next)
            self._next += 1
            frames.append(sse.named_event(type(event).__struct_config__.tag, event))
        return b"".join(frames)


def _failure_frames(numbered: _Numbered, reply: _Reply, items: _Items, error: ApiError) -> bytes:
    """The end of a stream that failed after its 200: the `error` event, then `response.failed`
    with the items so far, numbered after the events already sent."""
    detail = error.detail
    code = detail.code or detail.type
    failed = reply.snapshot("failed", items.output, error=ResponseError(code, detail.message))
    return numbered.frames([ResponseErrorEvent(0, detail.message, code, detail.param), ResponseFailed(0, failed)])


async def _stream(
    state: ServerState,
    generation: Generation,
    reply: _Reply,
    parsed: ChatChoices,
    items: _Items,
    numbered: _Numbered,
    conversation: list[dict[str, Any]],
    body: bytes,
    started_s: float,
) -> AsyncGenerator[bytes, None]:
    answer: ResponseObject | None = None
    try:
        start = reply.snapshot("in_progress", [])
        yield numbered.frames([ResponseCreated(0, start), ResponseInProgress(0, start)])
        async with aclosing(generation.batches()) as batches:
            async for batch in batches:
                events = []
                for update in batch:
                    events += items.events(parsed.apply(update))
                if events:
                    yield numbered.frames(events)
        events = items.finish()
        answer = reply.finished(generation, parsed, items.output)
        _store(state, reply, answer, conversation, parsed)
        done = ResponseIncomplete(0, answer) if answer.status == "incomplete" else ResponseCompleted(0, answer)
        yield numbered.frames([*events, done])
    finally:
        if state.dump is not None:
            state.dump.write("responses", 200, True, started_s, body,
                             answer or reply.finished(generation, parsed, items.output))
