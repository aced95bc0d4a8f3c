"""Framed msgpack messages over stream sockets, with deadlines: the mock communicator's wire.

    | length (8 bytes, big-endian) | msgpack body | length | body | ...

Every receive takes a deadline (a `time.monotonic()` value) so no wait can outlive it; the
end of the stream is reported as `None`, never as an exception, so callers can name the peer.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import msgspec

_HEADER = struct.Struct(">Q")
_RECEIVE_BYTES = 1 << 20
_CONNECT_RETRY_S = 0.01


class Hello(msgspec.Struct, tag=True):
    rank: int
    world_size: int


class Welcome(msgspec.Struct, tag=True):
    pass


class Contribution(msgspec.Struct, tag=True):
    """One rank's part of collective number `seq`: what it called and its bytes."""

    seq: int
    op: str
    dtype: str
    shape: list[int]
    data: bytes


class Delivery(msgspec.Struct, tag=True):
    data: bytes


class Abort(msgspec.Struct, tag=True):
    message: str
    rank: int | None


Message = Hello | Welcome | Contribution | Delivery | Abort


def new_address() -> bytes:
    """A fresh Unix socket address: in Linux's abstract namespace (nothing on disk to clean
    up, even after a kill), else a path in the temp folder that the listener unlinks."""
    token = secrets.token_hex(8)
    if sys.platform.startswith("linux"):
        return b"\0atlas-comm-" + token.encode()
    return str(Path(tempfile.gettempdir()) / f"atlas-comm-{token}.sock").encode()


def is_path(address: bytes) -> bool:
    return not address.startswith(b"\0")


class Link:
    """One connected stream socket carrying `Message`s."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(Message)

    @classmethod
    def connect(cls, address: bytes, deadline: float) -> Link | None:
        """Connect to a listener that may not be up yet, retrying until `deadline` (None then)."""
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address)
                return cls(sock)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() >= deadline:
                    return None
                time.sleep(_CONNECT_RETRY_S)

    def send(self, message: Message) -> None:
        """Send one message; OSError (BrokenPipeError, ...) when the peer is gone."""
        body = self._encode(message)
        self.sock.sendall(_HEADER.pack(len(body)) + body)

    def receive(self, deadline: float) -> Message | None:
        """The next message, None at the end of the stream; TimeoutError past `deadline`."""
        while True:
            message = self.take_buffered()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(_RECEIVE_BYTES)
            except socket.timeout:
                raise TimeoutError from None
            except OSError:
                return None
            if not data:
                return None
            self._buffer += data

    def feed(self) -> bool:
        """Read what has arrived (the socket is readable); False at the end of the stream."""
        try:
            data = self.sock.recv(_RECEIVE_BYTES)
        except OSError:
            return False
        self._buffer += data
        return bool(data)

    def take_buffered(self) -> Message | None:
        """A complete message already received, if any."""
        if len(self._buffer) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buffer)
        end = _HEADER.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[_HEADER.size:end])
        del self._buffer[:end]
        return self._decoder.decode(body)

    def shutdown(self) -> None:
        """Wake any thread blocked on this socket (it then sees the end of the stream)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def receive_from_each(links: dict[int, Link], deadline: float) -> tuple[dict[int, Message], list[int], list[int]]:
    """One message from every link, read as they arrive: (messages by rank, ranks whose
    stream ended, ranks still silent at `deadline`). Stops at the first end of stream, so a
    dead peer is reported at once rather than after the others' deadline."""
    messages: dict[int, Message] = {}
    for rank, link in links.items():
        message = link.take_buffered()
        if message is not None:
            messages[rank] = message
    with selectors.DefaultSelector() as selector:
        for rank, link in links.items():
            if rank not in messages:
                link.sock.setblocking(True)
                selector.register(link.sock, selectors.EVENT_READ, rank)
        while len(messages) < len(links):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return messages, [], sorted(set(links) - set(messages))
            for key, _ in selector.select(remaining):
                rank = key.data
                link = links[rank]
                if not link.feed():
                    return messages, [rank], []
                message = link.take_buffered()
                if message is not None:
                    messages[rank] = message
                    selector.unregister(link.sock)
    return messages, [], []
