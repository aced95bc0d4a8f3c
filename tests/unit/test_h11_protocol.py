"""`AtlasH11Protocol`: hypercorn's HTTP/1.1 protocol with chunks framed directly must put the
same bytes on the wire as hypercorn's own, for every framing h11 may choose, and leave h11's
state where h11 would. (Its error bodies are tests/e2e/test_bad_inputs.py's business.)"""

from __future__ import annotations

import h11
import pytest
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H11Protocol

from atlas.adapters.http.h11_protocol import AtlasH11Protocol, chunk

GET_11 = b"GET /v1/x HTTP/1.1\r\nhost: a\r\n\r\n"
GET_10 = b"GET /v1/x HTTP/1.0\r\n\r\n"
HEAD_11 = b"HEAD /v1/x HTTP/1.1\r\nhost: a\r\n\r\n"
SSE = [(b"content-type", b"text/event-stream")]
SIZED = [(b"content-type", b"application/json"), (b"content-length", b"11")]


@pytest.fixture
def anyio_backend():
    return "asyncio"


class _Context:
    event_class = type("Event", (), {})


async def wire(protocol_class, request: bytes, headers, bodies: list[bytes],
               h11_events: list | None = None) -> tuple[list[bytes], object]:
    """The bytes each send wrote for a response of `bodies`, and h11's state after it; the
    events h11 was given go to `h11_events`."""
    config = Config()
    config.include_date_header = config.include_server_header = False
    written: list[bytes] = []

    async def send(event) -> None:
        assert isinstance(event, RawData)
        written.append(event.data)

    protocol = protocol_class(None, config, _Context(), None, None, False, None, None, send)
    if h11_events is not None:
        h11_send = protocol.connection.send
        protocol.connection.send = lambda event: h11_events.append(type(event)) or h11_send(event)
    protocol.connection.receive_data(request)
    assert type(protocol.connection.next_event()) is h11.Request
    await protocol.stream_send(Response(stream_id=1, headers=list(headers), status_code=200))
    for data in bodies:
        await protocol.stream_send(Body(stream_id=1, data=data))
    await protocol.stream_send(EndBody(stream_id=1))
    return written, protocol.connection.our_state


@pytest.mark.anyio
@pytest.mark.parametrize("request_line,headers,bodies", [
    (GET_11, SSE, [b"data: a\n\n", b"", b"data: " + b"x" * 300 + b"\n\n"]),  # chunked
    (GET_11, SIZED, [b'{"a": ', b"", b"true}"]),  # Content-Length
    (GET_10, SSE, [b"data: a\n\n", b"data: b\n\n"]),  # HTTP/1.0: the body ends at the close
], ids=["chunked", "content-length", "http-1.0"])
async def test_every_framing_writes_what_hypercorn_writes(request_line, headers, bodies):
    ours, our_state = await wire(AtlasH11Protocol, request_line, headers, bodies)
    theirs, their_state = await wire(H11Protocol, request_line, headers, bodies)
    assert b"".join(ours) == b"".join(theirs) and our_state == their_state
    assert b"".join(ours).startswith(b"HTTP/1.")


@pytest.mark.anyio
async def test_a_chunked_stream_is_one_write_per_body_event_and_h11_sees_only_head_and_end():
    h11_events: list = []
    written, state = await wire(AtlasH11Protocol, GET_11, SSE, [b"data: a\n\n", b"data: bb\n\n"], h11_events)
    assert h11_events == [h11.Response, h11.EndOfMessage]
    head, *chunks = written
    assert b"\r\ntransfer-encoding: chunked\r\n" in head.lower()
    assert chunks == [b"9\r\ndata: a\n\n\r\n", b"a\r\ndata: bb\n\n\r\n", b"0\r\n\r\n"]
    assert state is h11.DONE


@pytest.mark.anyio
async def test_a_head_request_sends_no_body_bytes():
    ours, _ = await wire(AtlasH11Protocol, HEAD_11, SSE, [])
    theirs, _ = await wire(H11Protocol, HEAD_11, SSE, [])
    assert b"".join(ours) == b"".join(theirs) and b"".join(ours).endswith(b"\r\n\r\n")


def test_an_empty_chunk_writes_nothing():
    assert chunk(b"") == b"" and chunk(b"x" * 16) == b"10\r\n" + b"x" * 16 + b"\r\n"
