"""The bounded in-memory store of /v1/responses: what `previous_response_id` and GET read back.

Each entry is a response's JSON (for GET) and its conversation as chat messages, the request's
input and the response's output, without the instructions (OpenAI does not carry them over to
the next turn). The store holds at most `max_entries` entries and `max_bytes` bytes of both;
the least recently used go first, and an entry larger than the whole store is not kept.
Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_json: bytes  # the response object as GET returns it
    messages: tuple[dict[str, Any], ...]  # the conversation through this response's output

    @property
    def num_bytes(self) -> int:
        return len(self.response_json) + len(msgspec.json.encode(self.messages))


class ResponseStore:
    """Responses by id, least recently used dropped first (see the module doc)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's sizes must be 0 or more")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.num_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep `stored` (replacing an entry of the same id); False when it is larger than the store."""
        self.delete(response_id)
        size = stored.num_bytes
        if not self.enabled or size > self.max_bytes:
            return False
        self._entries[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, (_, evicted_size) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True
