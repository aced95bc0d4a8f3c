"""Hypercorn's HTTP/1.1 protocol as Atlas serves it: error bodies, and body chunks written directly.

Hypercorn has no hooks for either, so `install()` replaces the HTTP/1.1 protocol class its
connection wrapper instantiates by `AtlasH11Protocol`, which changes two things:

- Error bodies. Malformed HTTP/1.1 (a garbled request line, a negative Content-Length, two
  Transfer-Encodings) and a request line plus headers larger than `h11_max_incomplete_size` are
  answered by the protocol itself, with an empty body; here those answers carry the same JSON
  error object as every other rejection (400, 431 or 501, then the connection closes). HTTP/2
  reports such errors per connection or stream (GOAWAY, RST_STREAM), which carry no body.
- Chunk writes. A streamed response (SSE: one body event per token step, 64 streams at a
  time) is sent with `Transfer-Encoding: chunked`, and each body event would pass through h11's
  event and state machinery to become `<size in hex>\\r\\n<data>\\r\\n`: a large share of the API
  process's CPU under load. Once h11 has sent a response head that chose chunked framing, body
  events are framed here, byte for byte as h11's ChunkedWriter frames them; h11's state does
  not change on a chunk (its writer keeps no count for chunked bodies). The head, the end of
  the body (`0\\r\\n\\r\\n`), bodies of any other framing and everything after go through h11.
"""

from __future__ import annotations

import h11
import hypercorn.protocol
from hypercorn.events import RawData
from hypercorn.protocol.events import Body
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol

from atlas.adapters.http.errors import ApiError, status_error

_CHUNKED = b"\r\ntransfer-encoding: chunked\r\n"  # in a response head h11 wrote, lower-cased


def protocol_error(status: int, max_header_bytes: int) -> ApiError:
    """The error object for a status hypercorn's HTTP/1.1 parser chose."""
    if status == 431:
        return status_error(431, f"the request line and headers are larger than {max_header_bytes} bytes")
    if status == 501:
        return status_error(501, "this Transfer-Encoding is not supported; send Content-Length or chunked")
    return status_error(status, "malformed HTTP/1.1 request")


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body (h11's ChunkedWriter.send_data); b"" for no data,
    which as a chunk would read as the end of the body."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


class AtlasH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with error bodies and direct chunk writes (module doc)."""

    _chunked = False  # the response being sent has chunked framing (its head said so)

    async def stream_send(self, event: StreamEvent) -> None:
        if type(event) is Body and self._chunked and self.connection.our_state is h11.SEND_BODY:
            if event.data:
                await self.send(RawData(data=chunk(event.data)))
            return
        await super().stream_send(event)

    async def _send_h11_event(self, event) -> None:
        if type(event) is not h11.Response:
            await super()._send_h11_event(event)
            return
        try:  # as H11Protocol._send_h11_event, reading the framing h11 chose from the head
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        self._chunked = _CHUNKED in data.lower()
        await self.send(RawData(data=data))

    async def _send_error_response(self, status_code: int) -> None:
        body = protocol_error(status_code, self.config.h11_max_incomplete_size).body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def install() -> None:
    """Make hypercorn's HTTP/1.1 connections use `AtlasH11Protocol` (idempotent)."""
    hypercorn.protocol.H11Protocol = AtlasH11Protocol
