"""Error objects for what hypercorn rejects before the app sees a request.

Malformed HTTP/1.1 (a garbled request line, a negative Content-Length, two Transfer-Encodings)
and a request line plus headers larger than `h11_max_incomplete_size` are answered by
hypercorn's h11 protocol itself, with an empty body. `install()` makes those answers carry the
same JSON error object as every other rejection (400, 431 or 501, then the connection closes).
Hypercorn has no hook for this, so `install` replaces the HTTP/1.1 protocol class its
connection wrapper instantiates. HTTP/2 reports such errors per connection or stream (GOAWAY,
RST_STREAM), which carry no body.
"""

from __future__ import annotations

import h11
import hypercorn.protocol
from hypercorn.protocol.h11 import H11Protocol

from atlas.adapters.http.errors import ApiError, status_error


def protocol_error(status: int, max_header_bytes: int) -> ApiError:
    """The error object for a status hypercorn's HTTP/1.1 parser chose."""
    if status == 431:
        return status_error(431, f"the request line and headers are larger than {max_header_bytes} bytes")
    if status == 501:
        return status_error(501, "this Transfer-Encoding is not supported; send Content-Length or chunked")
    return status_error(status, "malformed HTTP/1.1 request")


class _H11WithErrorBodies(H11Protocol):
    async def _send_error_response(self, status_code: int) -> None:
        body = protocol_error(status_code, self.config.h11_max_incomplete_size).body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def install() -> None:
    """Make hypercorn's HTTP/1.1 protocol errors carry error objects (idempotent)."""
    hypercorn.protocol.H11Protocol = _H11WithErrorBodies
