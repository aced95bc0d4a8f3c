"""The `atlas bench serve` HTTP client against a scripted HTTP/1.1 server on loopback."""

from __future__ import annotations

import asyncio

import pytest

from atlas.app.bench.serve_client import Endpoint, fetch, stream_request

SSE = b'data: {"choices": [{"text": "hi"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 3, ' \
      b'"completion_tokens": 1}}\n\ndata: [DONE]\n\n'


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


class _Server:
    """Answers each request on a connection in turn: a JSON body or an SSE stream; after
    `requests_per_connection` answers it closes the connection, at once or (`close_late`) when
    the next request arrives, unanswered (a keep-alive timeout racing a request)."""

    def __init__(self, requests_per_connection: int, close_late: bool = False) -> None:
        self.requests_per_connection = requests_per_connection
        self.close_late = close_late
        self.num_connections = 0
        self.num_refused = 0  # requests that arrived on a connection being closed

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        for _ in range(self.requests_per_connection):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if head.startswith(b"POST /v1/completions"):
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                             b"Content-Type: text/event-stream\r\n\r\n" + _chunked(SSE))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        if self.close_late and await reader.read(1):
            self.num_refused += 1
        writer.close()


async def _serve(server: _Server, requests) -> None:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        await requests(Endpoint(f"http://127.0.0.1:{port}", None))


def test_requests_in_turn_share_one_kept_alive_connection():
    server = _Server(requests_per_connection=3)

    async def requests(endpoint: Endpoint) -> None:
        assert await fetch(endpoint, "GET", "/v1/models") == (200, b"{}")
        result = await stream_request(endpoint, "/v1/completions", b"{}")
        assert result.ok and result.output_tokens == 1 and len(result.chunk_times_s) == 1
        assert await fetch(endpoint, "GET", "/v1/models") == (200, b"{}")

    asyncio.run(_serve(server, requests))
    assert server.num_connections == 1


@pytest.mark.parametrize("close_late", [False, True])
def test_a_connection_the_server_closed_is_replaced(close_late):
    server = _Server(requests_per_connection=1, close_late=close_late)

    async def requests(endpoint: Endpoint) -> None:
        for _ in range(3):
            result = await stream_request(endpoint, "/v1/completions", b"{}")
            assert result.ok, result.error

    asyncio.run(_serve(server, requests))
    assert server.num_connections == 3
    assert server.num_refused == (2 if close_late else 0)  # each refused request was sent anew
