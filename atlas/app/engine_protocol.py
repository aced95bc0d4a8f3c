"""The wire protocol between the API process and the engine process.

Frames are a 4-byte big-endian length and a msgpack body (msgspec), over one end of a Unix
socket pair each:

    API -> engine:  Start(settings)            once; the engine loads the model
                    Commands([AddRequest | AbortRequest | Shutdown, ...])
    engine -> API:  Ready(...) | LoadFailed(...)
                    StepOutputs(outputs, failures, stats)   after each step, and after
                                                            commands that changed the state
                    Crashed(message)                        the step loop died
"""

from __future__ import annotations

import struct

import msgspec

from atlas.app.engine_actor import Command
from atlas.domain.engine_events import EngineFailure
from atlas.app.settings import EngineSettings
from atlas.domain.batch import SequenceOutput
from atlas.domain.engine import EngineStats

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30


class Start(msgspec.Struct, tag=True):
    settings: EngineSettings


class Commands(msgspec.Struct, tag=True):
    commands: list[Command]


class Ready(msgspec.Struct, tag=True):
    model_dir: str
    max_model_len: int
    vocab_size: int
    stats: EngineStats


class LoadFailed(msgspec.Struct, tag=True):
    message: str
    is_user_error: bool  # a ValueError/MemoryError naming the fix, not a bug


class RequestFailure(msgspec.Struct):
    request_id: str
    failure: EngineFailure


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[SequenceOutput]
    failures: list[RequestFailure]
    stats: EngineStats


class Crashed(msgspec.Struct, tag=True):
    message: str


ToEngine = Start | Commands
FromEngine = Ready | LoadFailed | StepOutputs | Crashed


class FrameBuffer:
    """Splits a byte stream into length-prefixed frames.

        | len (4 bytes, big-endian) | body (len bytes) | len | body | ...
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the frames now complete (a partial one stays buffered).
        Raises ValueError for a frame longer than MAX_FRAME_BYTES (a corrupt stream)."""
        self._buffer += data
        frames = []
        start = 0
        while len(self._buffer) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer, start)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes exceeds the limit; the stream is corrupt")
            end = start + HEADER.size + length
            if end > len(self._buffer):
                break
            frames.append(bytes(self._buffer[start + HEADER.size : end]))
            start = end
        del self._buffer[:start]
        return frames


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body
