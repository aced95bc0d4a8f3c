"""The key of one full block of token ids in the prefix cache, hashed once."""

from __future__ import annotations

from collections.abc import Sequence


class BlockKey:
    """`block_size` token ids; equal keys hold equal ids. The hash is computed once, at creation,
    so the radix tree's dict lookups never rehash the tokens."""

    __slots__ = ("token_ids", "_hash")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = tuple(token_ids)
        self._hash = hash(self.token_ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockKey) and self._hash == other._hash and self.token_ids == other.token_ids

    def __repr__(self) -> str:
        return f"BlockKey{self.token_ids}"
