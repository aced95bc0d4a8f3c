"""The HTTP client of `atlas bench serve`: a small HTTP/1.1 reader on asyncio streams.

Chunked or length-delimited bodies, SSE events split on blank lines. Connections are kept
alive and reused, one request at a time each, as the OpenAI SDK's pool does: a new TCP
connection per request would add the server's accept and connection set-up to every TTFT. It
costs the server's machine little CPU, which matters when client and server share a small
machine.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from array import array
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

# /tokenize requests in flight at once: preparing thousands of prompts must not open thousands
# of connections (or file descriptors) together.
_TOKENIZE_CONCURRENCY = 16


class Endpoint:
    """Where and how to send: parsed URL, headers, TLS, and the idle kept-alive connections.
    Raises ValueError for a bad URL."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http://HOST[:PORT] or https://... (got {url!r})")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        self.api_key = api_key
        self._idle: list[_Connection] = []

    def request_bytes(self, method: str, path: str, body: bytes = b"") -> bytes:
        lines = [f"{method} {self.base_path}{path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Accept: text/event-stream, application/json, text/plain"]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        if self.api_key:
            lines.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.reader.at_eof() and not connection.writer.is_closing():
                return connection
            connection.writer.close()
        return None

    def give_back(self, connection: _Connection) -> None:
        """Keep a connection whose response was read to its end, unless the server closes it."""
        if connection.reusable and not connection.reader.at_eof():
            self._idle.append(connection)
        else:
            connection.writer.close()


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reusable: bool = False  # the response was read whole and did not say `Connection: close`


async def _open(endpoint: Endpoint, method: str, path: str, body: bytes = b""):
    """Send a request on an idle connection, else a new one; returns (status, headers,
    connection) once the headers are read."""
    data = endpoint.request_bytes(method, path, body)
    connection = endpoint.take_idle()
    if connection is not None:
        try:
            connection.writer.write(data)
            status_line = await connection.reader.readline()
        except OSError:
            status_line = b""
        if not status_line:  # the server closed it while idle: send again on a new one
            connection.writer.close()
            connection = None
    if connection is None:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=endpoint.ssl, limit=1 << 20)
        connection = _Connection(reader, writer)
        writer.write(data)
        status_line = await reader.readline()
    if not status_line:
        connection.writer.close()
        raise ConnectionError("the server closed the connection without answering")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await connection.reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, connection


async def _body_pieces(connection: _Connection, headers: dict[str, str]):
    """The body as it arrives, de-chunked; marks the connection reusable once it is read whole."""
    reader = connection.reader
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(1 << 16):
            yield data
        return
    connection.reusable = headers.get("connection", "").lower() != "close"


async def fetch(endpoint: Endpoint, method: str, path: str, payload: dict | None = None) -> tuple[int, bytes]:
    """(status, whole body) of one request; OSError when the server cannot be reached."""
    body = json.dumps(payload).encode() if payload is not None else b""
    status, headers, connection = await _open(endpoint, method, path, body)
    try:
        return status, b"".join([piece async for piece in _body_pieces(connection, headers)])
    finally:
        endpoint.give_back(connection)


async def get_json(endpoint: Endpoint, path: str) -> dict:
    """GET a JSON document; ValueError naming the status unless it answers 200."""
    status, body = await fetch(endpoint, "GET", path)
    if status != 200:
        raise ValueError(f"GET {path} answered {status}: {body[:300]!r}")
    return json.loads(body)


@dataclass
class StreamResult:
    """One streamed request as the client saw it; times in seconds from when it was sent."""

    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    chunk_times_s: array = field(default_factory=lambda: array("d"))  # each chunk carrying text
    text: str = ""  # the generated text, when asked to keep it


class _StreamChunk(msgspec.Struct):
    choices: list[dict] = []
    usage: dict | None = None


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def stream_request(endpoint: Endpoint, path: str, body: bytes, keep_text: bool = False) -> StreamResult:
    """POST a streamed completion and time its chunks. Failures (connection, HTTP status,
    a broken stream, no text at all) come back as ok=False with the reason, never raised."""
    started_s = time.perf_counter()
    decode = msgspec.json.Decoder(_StreamChunk).decode
    try:
        status, headers, connection = await _open(endpoint, "POST", path, body)
    except (OSError, ValueError, IndexError) as error:
        return StreamResult(False, f"connect: {error}")
    result = StreamResult(True)
    pieces: list[str] = []
    pending = b""
    try:
        if status != 200:
            text = b"".join([piece async for piece in _body_pieces(connection, headers)])
            return StreamResult(False, f"HTTP {status}: {text[:200].decode('utf-8', 'replace')}")
        async for piece in _body_pieces(connection, headers):
            now = time.perf_counter() - started_s
            pending += piece.replace(b"\r\n", b"\n")  # SSE allows CRLF line ends
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = decode(event[6:])
                if chunk.usage:
                    _read_usage(chunk.usage, result)
                texts = [_chunk_text(choice) for choice in chunk.choices]
                if any(texts):
                    result.chunk_times_s.append(now)
                    if keep_text:
                        pieces.extend(texts)
    except (OSError, ValueError, asyncio.IncompleteReadError, msgspec.DecodeError) as error:
        return StreamResult(False, f"stream: {error}")
    finally:
        endpoint.give_back(connection)
    result.latency_s = time.perf_counter() - started_s
    if not result.chunk_times_s:
        return StreamResult(False, "the stream carried no text")
    result.ttft_s = result.chunk_times_s[0]
    result.text = "".join(pieces)
    return result


def _read_usage(usage: dict, result: StreamResult) -> None:
    result.prompt_tokens = usage.get("prompt_tokens") or 0
    result.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


class ServerTokenizer:
    """Exact counts from the server's `POST /tokenize` (Atlas and vLLM share its shape:
    {"model", "prompt" | "messages", "add_special_tokens"} -> {"count", "max_model_len", "tokens"})."""

    exact = True

    def __init__(self, endpoint: Endpoint, model: str, max_model_len: int | None) -> None:
        self._endpoint = endpoint
        self._model = model
        self.max_model_len = max_model_len
        self._gate = asyncio.Semaphore(_TOKENIZE_CONCURRENCY)

    @classmethod
    async def probe(cls, endpoint: Endpoint, model: str) -> ServerTokenizer | None:
        """The server's tokenizer, or None when it has no /tokenize (any 404, 405 or 400)."""
        status, body = await fetch(endpoint, "POST", "/tokenize", {"model": model, "prompt": "the"})
        if status in (400, 404, 405):
            return None
        answer = _tokenize_answer(status, body)
        return cls(endpoint, model, answer.get("max_model_len"))

    async def encode(self, text: str) -> list[int]:
        return await self._tokenize({"model": self._model, "prompt": text, "add_special_tokens": False})

    async def encode_prompt(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        """The whole prompt as the server sees it: BOS and chat template included."""
        if messages is not None:
            return await self._tokenize({"model": self._model, "messages": messages, "add_generation_prompt": True})
        return await self._tokenize({"model": self._model, "prompt": prompt})

    async def _tokenize(self, payload: dict) -> list[int]:
        async with self._gate:
            status, body = await fetch(self._endpoint, "POST", "/tokenize", payload)
        return _tokenize_answer(status, body)["tokens"]


def _tokenize_answer(status: int, body: bytes) -> dict:
    if status != 200:
        raise ValueError(f"POST /tokenize answered {status}: {body[:200].decode('utf-8', 'replace')}")
    answer = json.loads(body)
    if not isinstance(answer.get("tokens"), list):
        raise ValueError(f"POST /tokenize answered without a 'tokens' list: {body[:200]!r}")
    return answer
