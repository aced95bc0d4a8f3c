"""The storage port: KV blocks written to and read from a slower tier (NVMe, files)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol


class StorageBackend(Protocol):
    """Keyed byte storage with asynchronous completion.

    `write` and `read` return awaitables that complete when the bytes are durable in the tier
    (write) or in `into` (read). A missing key raises KeyError; a full tier raises OSError
    naming the capacity.
    """

    @property
    def capacity_bytes(self) -> int: ...

    def write(self, key: str, data: bytes | memoryview) -> Awaitable[None]: ...

    def read(self, key: str, into: memoryview) -> Awaitable[int]: ...

    def delete(self, key: str) -> None: ...
