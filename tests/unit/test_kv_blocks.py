"""The paged KV block pool: check-then-commit reservations, ref counts, deterministic ids."""

from __future__ import annotations

import pytest

from atlas.domain.cache.block_pool import BlockPool


def test_commit_hands_out_lowest_ids_first_with_ref_count_one() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    reservation = pool.reserve(3)
    assert reservation is not None
    assert pool.num_free_blocks == 5 and pool.num_reserved_blocks == 3 and pool.num_used_blocks == 0
    assert pool.commit(reservation) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 5 and pool.num_reserved_blocks == 0 and pool.num_used_blocks == 3
    pool.check_invariants()


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    first = pool.commit(pool.reserve(6))
    assert first == [0, 1, 2, 3, 4, 5]
    pool.free([4, 1])
    pool.check_invariants()
    # 6 and 7 were never used, so they come before the freed 4, then 1.
    assert pool.commit(pool.reserve(4)) == [6, 7, 4, 1]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_failed_reservation_changes_nothing() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    held = pool.commit(pool.reserve(5))
    pending = pool.reserve(2)
    assert pending is not None
    before = (pool.num_free_blocks, pool.num_used_blocks, pool.num_reserved_blocks)
    assert before == (1, 5, 2)
    assert pool.reserve(2) is None
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_reserved_blocks) == before
    pool.check_invariants()
    # The earlier reservation is still honoured in full.
    assert pool.commit(pending) == [5, 6]
    assert held == [0, 1, 2, 3, 4]
    assert pool.commit(pool.reserve(1)) == [7]
    assert pool.reserve(1) is None
    pool.check_invariants()


def test_reservation_cannot_be_committed_twice_or_in_another_pool() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    other = BlockPool(num_blocks=8, block_size=4)
    reservation = pool.reserve(2)
    foreign = other.reserve(2)
    with pytest.raises(ValueError, match="another block pool"):
        pool.commit(foreign)
    assert pool.num_used_blocks == 0 and pool.num_reserved_blocks == 2
    assert pool.commit(reservation) == [0, 1]
    with pytest.raises(ValueError, match="already committed"):
        pool.commit(reservation)
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 6
    assert other.commit(foreign) == [0, 1]
    pool.check_invariants()
    other.check_invariants()


def test_cancel_returns_reserved_blocks_and_spends_the_reservation() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    reservation = pool.reserve(7)
    assert pool.reserve(2) is None
    pool.cancel(reservation)
    assert pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="already committed or cancelled"):
        pool.commit(reservation)
    assert pool.commit(pool.reserve(8)) == list(range(8))
    pool.check_invariants()


def test_ref_counts_keep_a_shared_block_until_its_last_holder_frees_it() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    block_ids = pool.commit(pool.reserve(2))
    pool.incref([block_ids[0], block_ids[0]])
    assert pool.ref_count(0) == 3 and pool.ref_count(1) == 1
    pool.free(block_ids)
    assert pool.ref_count(0) == 2 and pool.ref_count(1) == 0
    assert pool.num_free_blocks == 7 and pool.num_used_blocks == 1
    pool.free([0])
    pool.check_invariants()
    assert pool.num_free_blocks == 7
    pool.free([0])
    assert pool.num_free_blocks == 8 and pool.ref_count(0) == 0
    pool.check_invariants()


def test_double_free_and_bad_ids_raise_without_partial_change() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.commit(pool.reserve(3))
    with pytest.raises(ValueError, match="block 1 has 1 holder"):
        pool.free([0, 1, 1])
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([2, 8])
    assert pool.ref_count(2) == 1
    with pytest.raises(ValueError, match="block 5 is free"):
        pool.incref([0, 5])
    assert pool.ref_count(0) == 1
    with pytest.raises(ValueError, match="negative"):
        pool.reserve(-1)
    assert pool.num_free_blocks == 5
    pool.check_invariants()


def test_reserving_zero_blocks_succeeds_even_when_full() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.commit(pool.reserve(2))
    empty = pool.reserve(0)
    assert empty is not None
    assert pool.commit(empty) == []
    pool.check_invariants()


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (33, 16, 3)],
)
def test_blocks_needed_rounds_up(num_tokens: int, block_size: int, expected: int) -> None:
    assert BlockPool.blocks_needed(num_tokens, block_size) == expected


def test_default_block_size_is_sixteen_and_sizes_are_validated() -> None:
    assert BlockPool(num_blocks=3).block_size == 16
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_tokens"):
        BlockPool.blocks_needed(-1, 4)


def test_check_invariants_catches_corrupted_bookkeeping() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.commit(pool.reserve(2))
    pool.check_invariants()
    pool._free_ids.append(0)  # a used block put back on the free list behind the pool's back
    with pytest.raises(AssertionError):
        pool.check_invariants()

    leaky = BlockPool(num_blocks=4, block_size=4)
    leaky.commit(leaky.reserve(1))
    leaky._ref_counts[0] = 0  # dropped to zero without returning to the free list
    with pytest.raises(AssertionError, match="free \\(3\\) \\+ used \\(0\\) != total \\(4\\)"):
        leaky.check_invariants()
