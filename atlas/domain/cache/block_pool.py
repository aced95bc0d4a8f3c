"""The paged KV block pool: which cache pages are free, and how many holders each used one has.

The KV cache is `num_blocks` pages of `block_size` token slots. A sequence's block table lists
the pages holding its positions in order; position `p` lives in page `table[p // block_size]`
at offset `p % block_size`:

    block_size 4, table [7, 2, 5]
    positions  0 1 2 3 | 4 5 6 7 | 8 9
    page       7       | 2       | 5 (slots 8, 9 used; 10, 11 free for the next tokens)

Allocation is check, then commit: `reserve(n)` either sets `n` pages aside and returns a
`Reservation`, or returns None and changes nothing; `commit(reservation)` hands out the pages,
each with ref count 1. Pages are shared by raising their ref count (`incref`) and given back by
lowering it (`free`); a page whose count reaches 0 returns to the end of the free list, so pages
are reused least-recently-freed first and the order is deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable

import msgspec

_pool_uids = itertools.count(1)


class Reservation(msgspec.Struct, frozen=True):
    """A promise of `num_blocks` pages from one pool, redeemable once by `BlockPool.commit`."""

    num_blocks: int
    pool_uid: int
    serial: int


class BlockPool:
    """Free list and ref counts of the KV cache pages `0 .. num_blocks - 1`.

    Every page is either free (ref count 0, on the free list) or used (ref count >= 1, off it).
    Reserved pages stay on the free list but are not counted in `num_free_blocks`, so a
    reservation can always be committed.
    """

    __slots__ = ("num_blocks", "block_size", "_free_ids", "_ref_counts", "_num_reserved", "_outstanding", "_uid")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        """Raises ValueError unless both sizes are positive."""
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block (got num_blocks={num_blocks})")
        if block_size < 1:
            raise ValueError(f"block_size must be positive (got {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._num_reserved = 0
        self._outstanding: dict[int, Reservation] = {}
        self._uid = next(_pool_uids)

    @staticmethod
    def blocks_needed(num_tokens: int, block_size: int) -> int:
        """Pages that hold `num_tokens` positions: ceil(num_tokens / block_size). Raises on bad sizes."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0 (got {num_tokens})")
        if block_size < 1:
            raise ValueError(f"block_size must be positive (got {block_size})")
        return -(-num_tokens // block_size)

    @property
    def num_free_blocks(self) -> int:
        """Pages that a new reservation can still take (free and not reserved)."""
        return len(self._free_ids) - self._num_reserved

    @property
    def num_used_blocks(self) -> int:
        """Pages with a ref count of at least 1."""
        return self.num_blocks - len(self._free_ids)

    @property
    def num_reserved_blocks(self) -> int:
        """Pages set aside by reservations not yet committed or cancelled."""
        return self._num_reserved

    def ref_count(self, block_id: int) -> int:
        """How many holders page `block_id` has (0 when free). Raises ValueError for an unknown id."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def reserve(self, num_blocks: int) -> Reservation | None:
        """Set `num_blocks` pages aside, or return None (changing nothing) when too few are free.

        Raises ValueError for a negative count. Reserving 0 pages always succeeds.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot reserve a negative number of blocks ({num_blocks})")
        if num_blocks > self.num_free_blocks:
            return None
        reservation = Reservation(num_blocks=num_blocks, pool_uid=self._uid, serial=next(_pool_uids))
        self._outstanding[reservation.serial] = reservation
        self._num_reserved += num_blocks
        return reservation

    def commit(self, reservation: Reservation) -> list[int]:
        """Turn a reservation into page ids, each with ref count 1, oldest-freed first.

        Raises ValueError, changing nothing, for a reservation from another pool or one already
        committed or cancelled.
        """
        self._take_outstanding(reservation)
        self._num_reserved -= reservation.num_blocks
        block_ids = [self._free_ids.popleft() for _ in range(reservation.num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def cancel(self, reservation: Reservation) -> None:
        """Give a reservation's pages back without using them. Raises like `commit`."""
        self._take_outstanding(reservation)
        self._num_reserved -= reservation.num_blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each listed page (listed twice: two holders).

        Raises ValueError, changing nothing, if a page is unknown or free: only a used page can be
        shared.
        """
        listed = block_ids if isinstance(block_ids, (list, tuple)) else list(block_ids)
        ref_counts = self._ref_counts
        for block_id in listed:
            self._check_id(block_id)
            if ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; only a used block can gain a holder")
        for block_id in listed:
            ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each listed page; a page left with none returns to the free list.

        Raises ValueError, changing nothing, if a page is unknown or would drop below 0 holders
        (a double free).
        """
        ordered = list(block_ids)
        counts = Counter(ordered)
        for block_id, count in counts.items():
            self._check_id(block_id)
            if self._ref_counts[block_id] < count:
                raise ValueError(
                    f"block {block_id} has {self._ref_counts[block_id]} holder(s) but is freed {count} time(s)"
                )
        for block_id in ordered:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_ids.append(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        Checked: free + used == total, no page twice on the free list, free pages have ref
        count 0 and used ones >= 1, reservations fit in the free list and add up.
        """
        free_set = set(self._free_ids)
        if len(free_set) != len(self._free_ids):
            raise AssertionError(f"a block is on the free list twice: {sorted(self._free_ids)}")
        used = [b for b in range(self.num_blocks) if self._ref_counts[b] > 0]
        if len(free_set) + len(used) != self.num_blocks:
            raise AssertionError(f"free ({len(free_set)}) + used ({len(used)}) != total ({self.num_blocks})")
        for block_id in range(self.num_blocks):
            count = self._ref_counts[block_id]
            if count < 0:
                raise AssertionError(f"block {block_id} has a negative ref count {count}")
            if (count == 0) != (block_id in free_set):
                raise AssertionError(f"block {block_id} has ref count {count} but free-list membership disagrees")
        reserved = sum(r.num_blocks for r in self._outstanding.values())
        if reserved != self._num_reserved or not 0 <= self._num_reserved <= len(self._free_ids):
            raise AssertionError(
                f"reserved count {self._num_reserved} disagrees with reservations ({reserved}) "
                f"or exceeds the free list ({len(self._free_ids)})"
            )

    def _take_outstanding(self, reservation: Reservation) -> None:
        if reservation.pool_uid != self._uid:
            raise ValueError("this reservation was made by another block pool")
        if self._outstanding.get(reservation.serial) is not reservation:
            raise ValueError("this reservation was already committed or cancelled")
        del self._outstanding[reservation.serial]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool (0 .. {self.num_blocks - 1})")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, reserved={self._num_reserved})"
        )
