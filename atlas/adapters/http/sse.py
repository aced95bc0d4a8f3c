"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` frames, then `data: [DONE]`.

JSON never contains a raw newline (msgspec escapes them in strings), so one event is always
one `data:` line.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import msgspec

from atlas.adapters.http.errors import SERVER_ERROR, ApiError

log = logging.getLogger("atlas.http")

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

encode_json = msgspec.json.Encoder().encode


def event(payload: object) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def error_event(error: ApiError) -> bytes:
    """An error after the 200 headers went out: the OpenAI SDK raises it as an APIError."""
    return b"data: " + error.body() + b"\n\n"


async def with_errors(frames: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """Pass frames through; an ApiError mid-stream becomes an error event, then the stream ends.

    Closing this generator (the client went away) closes `frames` at once, so its cleanup
    (aborting the engine requests) runs now rather than whenever it is garbage collected.
    """
    try:
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except ApiError as error:
        yield error_event(error)
        yield DONE
    except Exception as error:  # a bug: say so in the stream rather than cutting it off
        log.exception("stream failed")
        yield error_event(ApiError(500, f"internal error: {type(error).__name__}", SERVER_ERROR))
        yield DONE
