"""What one sequence holds in the cache: its pages per group, its path in the prefix cache, and
the keys of its full blocks. A `Sequence` owns one; only the `CacheManager` changes it."""

from __future__ import annotations

from atlas.domain.cache.block_key import BlockKey
from atlas.domain.cache.radix_tree import RadixNode


class GroupHolding:
    """One group's pages of a sequence: page `block_ids[k]` holds block `first_block_idx + k`.

        sliding window, first_block_idx 2, block_ids (7, 3)
        block     0   1 | 2   3
        page      released | 7   3

    `block_ids` is a tuple, rebound whenever the pages change: a step hands it to the worker
    as the sequence's block table without a copy, and the worker may keep what it derived
    from it (its rows of the step's table) while it is the same object.
    """

    __slots__ = ("first_block_idx", "block_ids")

    def __init__(self) -> None:
        self.first_block_idx = 0
        self.block_ids: tuple[int, ...] = ()

    @property
    def num_covered(self) -> int:
        """Blocks covered so far, released ones included."""
        return self.first_block_idx + len(self.block_ids)

    def block_at(self, block_idx: int) -> int | None:
        """The page of block `block_idx`, or None when it was released or is not held yet."""
        offset = block_idx - self.first_block_idx
        return self.block_ids[offset] if 0 <= offset < len(self.block_ids) else None

    def release_first(self) -> int:
        """Give up the first held page (it left a sliding window); returns its id."""
        self.first_block_idx += 1
        first, self.block_ids = self.block_ids[0], self.block_ids[1:]
        return first


class CacheHoldings:
    """A sequence's cache state.

    `groups[g]` is its holding in cache group g (empty until admitted). `nodes[i]` is the
    prefix cache's node for its full block i: blocks 0 .. len(nodes) - 1 have been offered to
    the cache, and the sequence pins node i's page in every group where it holds block i.
    `keys[i]` is block i's key; keys depend only on tokens that never change, so they survive
    preemption and are computed once. `path_ended`: the cache takes no more of its blocks (it
    keeps none, or the path's last node was evicted). `num_tokens_covered`: tokens its pages
    hold room for in every group; growing up to it needs no page.
    """

    __slots__ = ("groups", "nodes", "keys", "path_ended", "num_tokens_covered")

    def __init__(self) -> None:
        self.groups: list[GroupHolding] = []
        self.nodes: list[RadixNode] = []
        self.keys: list[BlockKey] = []
        self.path_ended = False
        self.num_tokens_covered = 0

    @property
    def is_empty(self) -> bool:
        """Holds no page and pins nothing (a waiting or finished sequence)."""
        return not self.nodes and all(not holding.block_ids for holding in self.groups)

    def open(self, num_groups: int) -> None:
        """Start holding in `num_groups` groups (at admission). Raises ValueError if not empty."""
        if not self.is_empty:
            raise ValueError("a sequence already holding cache pages was admitted again")
        self.groups = [GroupHolding() for _ in range(num_groups)]

    def clear(self) -> None:
        """Forget pages and path (their holders were dropped by the manager); keep the keys."""
        self.groups = []
        self.nodes = []
        self.path_ended = False
        self.num_tokens_covered = 0

    def __repr__(self) -> str:
        tables = [(h.first_block_idx, h.block_ids) if h.first_block_idx else h.block_ids for h in self.groups]
        return f"CacheHoldings({tables}, cached={len(self.nodes)})"
