"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

The body becomes a `ChatTurn` (`anthropic_mapping`) and runs as one chat choice; errors use
Anthropic's shape on these routes (`errors.ApiError.anthropic`). A stream is Anthropic's
event sequence:

    message_start  ping
    content_block_start(thinking)  content_block_delta(thinking_delta)...  (signature_delta)  content_block_stop
    content_block_start(text)      content_block_delta(text_delta)...                         content_block_stop
    content_block_start(tool_use)  content_block_delta(input_json_delta)...                   content_block_stop
    message_delta(stop_reason, usage)  message_stop

Blocks open as their first piece arrives and close when the next kind of block begins. A
`ping` also goes out whenever the engine has written nothing for PING_INTERVAL_S (a long
prompt's prefill), so proxies and clients do not time the stream out.
"""

from __future__ import annotations

import random
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from quart import Response

from atlas.adapters.http import sse
from atlas.adapters.http.anthropic_mapping import (
    anthropic_tool_id,
    anthropic_turn,
    content_blocks,
    requested_sampling,
    stop_reason,
    thinking_signature,
)
from atlas.adapters.http.anthropic_schemas import (
    AnthropicUsage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDelta,
    StopInfo,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    TokenCountOut,
    ToolUseOut,
    unsupported_anthropic_features,
)
from atlas.adapters.http.chat_choices import ChatChoices, ChoiceParts
from atlas.adapters.http.chat_turn import count_prompt_tokens, prepare_turn
from atlas.adapters.http.choices import ChoiceResults, collect
from atlas.adapters.http.errors import bad_request
from atlas.adapters.http.generation import Generation
from atlas.adapters.http.params import build_sampling_params
from atlas.adapters.http.state import ServerState, decode_body

JSON = "application/json"
PING_INTERVAL_S = 10.0


async def messages(state: ServerState, body: bytes) -> Response:
    """Answer one Messages request; raises ApiError for anything the client got wrong."""
    started_s = time.monotonic()
    request = decode_body(body, MessagesRequest)
    model, engine = state.ready(request.model)
    unsupported = unsupported_anthropic_features(request)
    if unsupported is not None:
        raise bad_request(*unsupported)
    turn = await prepare_turn(model, anthropic_turn(request))
    params = turn.sampling(build_sampling_params(requested_sampling(request), len(turn.prompt_ids),
                                                 model.max_model_len, model.vocab_size, model.sampling_defaults))
    message_id = f"msg_{uuid.uuid4().hex}"
    generation = Generation(engine, model.tokenizer, message_id, [turn.prompt_ids], params, state.seeds,
                            state.metrics, state.in_flight, state.config.request_timeout_s,
                            constraint=turn.constraint, heartbeat_s=PING_INTERVAL_S if request.stream else None)
    parsed = ChatChoices(1, turn.reading, random.Random(secrets.randbits(64)))
    if request.stream:
        frames = _stream(state, generation, message_id, model.name, parsed, body, started_s)
        return Response(sse.with_errors(frames, sse.anthropic_error_event), 200, sse.HEADERS)
    await collect(generation, ChoiceResults(1, False), parsed.apply)
    answer = _message(message_id, model.name, generation, parsed)
    if state.dump is not None:
        state.dump.write("messages", 200, False, started_s, body, answer)
    return Response(sse.encode_json(answer), 200, content_type=JSON)


async def count_tokens(state: ServerState, body: bytes) -> Response:
    """The prompt's token count, as /v1/messages would render it."""
    request = decode_body(body, CountTokensRequest)
    model, _ = state.ready(request.model)
    unsupported = unsupported_anthropic_features(request)
    if unsupported is not None:
        raise bad_request(*unsupported)
    num_tokens = await count_prompt_tokens(model, anthropic_turn(request))
    return Response(sse.encode_json(TokenCountOut(num_tokens)), 200, content_type=JSON)


def _message(message_id: str, model_name: str, generation: Generation, parsed: ChatChoices) -> MessageOut:
    reason, sequence = stop_reason(parsed, 0)
    cached = generation.num_cached_tokens  # Anthropic counts cache reads apart from input_tokens
    usage = AnthropicUsage(generation.num_prompt_tokens - cached, generation.num_output_tokens,
                           cache_read_input_tokens=cached)
    return MessageOut(message_id, model_name, content_blocks(parsed, 0), reason, sequence, usage)


class _Blocks:
    """Anthropic's content-block events for one choice's parts, opening and closing blocks."""

    def __init__(self) -> None:
        self._index = -1
        self._open: tuple[str, int] | None = None  # (kind, call index) of the open block
        self._thinking: list[str] = []
        self._text_frames: sse.TextFrames | None = None  # text deltas of the open text block

    def events(self, parts: ChoiceParts) -> list[bytes]:
        events = []
        if parts.reasoning:
            events += self._begin(("thinking", 0), ThinkingOut("", ""))
            self._thinking.append(parts.reasoning)
            events.append(self._delta(ThinkingDelta(parts.reasoning)))
        if parts.content:
            events += self._begin(("text", 0), TextOut(""))
            if self._text_frames is None:
                self._text_frames = sse.TextFrames(lambda text: self._delta(TextDelta(text)))
            events.append(self._text_frames(parts.content))
        for call in parts.tool_calls:
            if call.id is not None:
                events += self._begin(("tool_use", call.index),
                                      ToolUseOut(anthropic_tool_id(call.id), call.name or "", {}))
            if call.arguments:
                events.append(self._delta(InputJsonDelta(call.arguments)))
        return events

    def finish(self) -> list[bytes]:
        """Close the open block; a message with no block at all gets an empty text block."""
        events = [] if self._open is not None else self._begin(("text", 0), TextOut(""))
        return events + self._close()

    def _begin(self, key: tuple[str, int], block) -> list[bytes]:
        if self._open == key:
            return []
        events = self._close()
        self._index += 1
        self._open = key
        self._text_frames = None
        return events + [sse.named_event("content_block_start", ContentBlockStart(self._index, block))]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        events = []
        if self._open[0] == "thinking":
            signature = thinking_signature("".join(self._thinking))
            events.append(self._delta(SignatureDelta(signature)))
            self._thinking.clear()
        self._open = None
        return events + [sse.named_event("content_block_stop", ContentBlockStop(self._index))]

    def _delta(self, delta) -> bytes:
        return sse.named_event("content_block_delta", ContentBlockDelta(self._index, delta))


async def _stream(
    state: ServerState,
    generation: Generation,
    message_id: str,
    model_name: str,
    parsed: ChatChoices,
    body: bytes,
    started_s: float,
) -> AsyncGenerator[bytes, None]:
    blocks = _Blocks()
    try:
        start = MessageOut(message_id, model_name, [], None, None,
                           AnthropicUsage(generation.num_prompt_tokens, 0))
        yield sse.named_event("message_start", MessageStart(start)) + sse.named_event("ping", Ping())
        async with aclosing(generation.batches()) as batches:
            async for batch in batches:
                if not batch:  # the heartbeat: nothing written for PING_INTERVAL_S
                    yield sse.named_event("ping", Ping())
                    continue
                frames = []
                for update in batch:
                    frames += blocks.events(parsed.apply(update))
                if frames:
                    yield b"".join(frames)
        reason, sequence = stop_reason(parsed, 0)
        cached = generation.num_cached_tokens
        usage = DeltaUsage(generation.num_output_tokens, generation.num_prompt_tokens - cached, cached)
        last = MessageDelta(StopInfo(reason, sequence), usage)
        yield b"".join([*blocks.finish(), sse.named_event("message_delta", last),
                        sse.named_event("message_stop", MessageStop())])
    finally:
        if state.dump is not None:
            answer = _message(message_id, model_name, generation, parsed)
            state.dump.write("messages", 200, True, started_s, body, answer)
