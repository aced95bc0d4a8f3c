"""`--dump PATH`: one JSON line per request with its response (a stream's is aggregated).

    {"time": 1732230000.12, "endpoint": "chat", "status": 200, "stream": true,
     "duration_s": 0.41, "request": {...as sent...}, "response": {...}}

Lines are written whole and flushed, from the event loop only, so concurrent requests never
interleave inside a line. A body that is not JSON is recorded as a string.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec

log = logging.getLogger("atlas.http")


class DumpRecord(msgspec.Struct):
    time: float
    endpoint: str
    status: int
    stream: bool
    duration_s: float
    request: msgspec.Raw | str
    response: object


class DumpWriter:
    """Appends records to a JSONL file; a write error is logged once and dumping stops."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()

    def write(self, endpoint: str, status: int, stream: bool, started_s: float, body: bytes, response: object) -> None:
        if self._file is None:
            return
        try:
            msgspec.json.decode(body)
            request: msgspec.Raw | str = msgspec.Raw(body)
        except (msgspec.DecodeError, ValueError):
            request = body.decode("utf-8", "replace")
        record = DumpRecord(time.time(), endpoint, status, stream, round(time.monotonic() - started_s, 6), request,
                            response)
        try:
            self._file.write(self._encoder.encode(record) + b"\n")
            self._file.flush()
        except (OSError, TypeError, ValueError) as error:
            log.error("--dump: cannot write %s (%s); dumping stops", self.path, error)
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
