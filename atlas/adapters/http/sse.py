"""Server-sent events: OpenAI's chat streams (`data: <json>\\n\\n` frames, then `data: [DONE]`)
and the named events of Anthropic's and the Responses API's (`event: <type>\\ndata: <json>`).

JSON never contains a raw newline (msgspec escapes them in strings), so one event is always
one `data:` line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import msgspec

from atlas.adapters.http.errors import SERVER_ERROR, ApiError

log = logging.getLogger("atlas.http")

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

encode_json = msgspec.json.Encoder().encode


def event(payload: object) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def named_event(name: str, payload: object) -> bytes:
    """`event: name` with the payload as its data (Anthropic's and the Responses API's streams)."""
    return b"event: " + name.encode() + b"\ndata: " + encode_json(payload) + b"\n\n"


class TextFrames:
    """Frames of one shape that differ only in one string (a token step's text), each built by
    splicing that string's JSON into the frame encoded once: a stream's every chunk then costs
    one string's encoding instead of a Struct tree's construction and encoding.

    `make(text)` is the frame for `text` (an `event` or `named_event` of Structs); it is called
    once, with a placeholder, so `frames(text) == make(text)` byte for byte for every text
    (msgspec encodes a field the same wherever the others are).
    """

    __slots__ = ("_head", "_tail")
    _PLACEHOLDER = "\x00atlas text\x00"

    def __init__(self, make: Callable[[str], bytes]) -> None:
        placeholder = encode_json(self._PLACEHOLDER)
        frame = make(self._PLACEHOLDER)
        if frame.count(placeholder) != 1:
            raise ValueError("the frame must hold the text exactly once")
        self._head, _, self._tail = frame.partition(placeholder)

    def __call__(self, text: str) -> bytes:
        return self._head + encode_json(text) + self._tail


def error_event(error: ApiError) -> bytes:
    """An error after the 200 headers went out: the OpenAI SDK raises it as an APIError."""
    return b"data: " + error.body() + b"\n\n" + DONE


def anthropic_error_event(error: ApiError) -> bytes:
    """Anthropic's `event: error`; its SDK raises it as an APIError."""
    return named_event("error", error.anthropic())


async def with_errors(
    frames: AsyncGenerator[bytes, None], on_error: Callable[[ApiError], bytes] = error_event
) -> AsyncIterator[bytes]:
    """Pass frames through; an ApiError mid-stream becomes `on_error(error)` (the API's error
    event), then the stream ends.

    Closing this generator (the client went away) closes `frames` at once, so its cleanup
    (aborting the engine requests) runs now rather than whenever it is garbage collected.
    """
    try:
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except ApiError as error:
        yield on_error(error)
    except Exception as error:  # a bug: say so in the stream rather than cutting it off
        log.exception("stream failed")
        yield on_error(ApiError(500, f"internal error: {type(error).__name__}", SERVER_ERROR))
