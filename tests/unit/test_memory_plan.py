"""The startup memory arithmetic: exact page counts per cache group, and messages that name the fix."""

import pytest

from atlas.domain.memory_plan import GIB, CacheDemand, MemoryPlanError, check_weights_fit, plan_cache
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, StateShape
from atlas.ports.gpu import DType

# 16 layers of 8 KV heads x 128 in bf16: a block of 16 tokens is 2 * 16 * 16 * 8 * 128 * 2 = 1 MiB
FULL = CacheGroupSpec(KvShape(8, 128), tuple(range(16)))
SLIDING = CacheGroupSpec(KvShape(8, 128, sliding_window=64), tuple(range(16, 48)))  # 2 MiB a block
STATE = CacheGroupSpec(StateShape(conv_dim=1024, conv_kernel=4, num_heads=8, key_dim=64, value_dim=64), (48, 49))
MIB = 2**20


def plan(groups, demand=CacheDemand(8, 64, 4096), **memory):
    arguments = dict(free_bytes=60 * GIB, total_bytes=80 * GIB, utilization=0.9, reserved_bytes=2 * GIB)
    arguments.update(memory)
    return plan_cache(groups=groups, kv_dtype=DType.BF16, block_size=16, demand=demand, **arguments)


def test_kv_blocks_from_utilisation():
    result = plan([FULL])
    # 72 GiB usable - 20 in use - 2 reserved = 50 GiB = 51200 blocks of 1 MiB, one kept as scratch
    assert result.num_pages == (51199,) and result.bytes_per_page == (MIB,)
    assert result.total_bytes == 50 * GIB


def test_fixed_kv_budget_is_capped_by_free_memory():
    result = plan([FULL], free_bytes=3 * GIB, total_bytes=8 * GIB, utilization=0.5, reserved_bytes=GIB,
                  kv_budget_bytes=10 * GIB)
    assert result.num_pages == (2047,)  # 2 GiB free after the reservation = 2048 blocks, less scratch


def test_state_slots_come_first_then_the_full_group_then_the_windows_what_they_need():
    result = plan([FULL, SLIDING, STATE], CacheDemand(max_num_seqs=8, max_step_tokens=64, max_model_len=4096))
    state_slot = 2 * (1024 * 3 + 8 * 64 * 64) * 4  # two layers of conv + recurrent state in f32
    assert result.bytes_per_page == (MIB, 2 * MIB, state_slot)
    # window 64: a decoding sequence holds ceil(63 / 16) + 1 = 5 blocks; 8 of them plus a step of 64 tokens
    windows = 8 * 5 + 4
    full = (50 * GIB - 9 * state_slot - (windows + 1) * 2 * MIB) // MIB - 1
    assert result.num_pages == (full, windows, 8)
    assert result.total_bytes <= 50 * GIB < result.total_bytes + MIB


def test_a_window_never_gets_more_blocks_than_the_full_group_nor_fewer_than_one_step():
    # 32 blocks of full attention fit only one sequence of 512 tokens: the window takes as many
    tight = plan([FULL, SLIDING], CacheDemand(64, 64, 512), kv_budget_bytes=(33 + 33 * 2) * MIB)
    assert tight.num_pages == (32, 32)
    # without a full-attention group nothing bounds the window's share: it takes the budget
    alone = plan([SLIDING], CacheDemand(64, 64, 512), kv_budget_bytes=100 * MIB)
    assert alone.num_pages == (49,)
    with pytest.raises(MemoryPlanError, match=r"sliding-window layers need 0.02 GiB.*--max-prefill-tokens 64"):
        plan([SLIDING], CacheDemand(64, 64, 512), kv_budget_bytes=9 * MIB)  # one step touches 8 blocks


def test_too_little_memory_says_what_fits_and_which_flags():
    with pytest.raises(MemoryPlanError) as caught:
        plan([FULL], CacheDemand(8, 64, 131072), free_bytes=10 * GIB, reserved_bytes=0)
    message = str(caught.value)
    # 72 GiB usable - 70 in use = 2 GiB = 2048 blocks, one kept as scratch
    assert "2047 blocks of 16 tokens" in message
    assert "--max-seq-len 32752" in message and "needs 8192 blocks" in message and "--gpu-memory-utilization" in message


def test_state_slots_that_do_not_fit_name_the_sequences_that_would():
    with pytest.raises(MemoryPlanError) as caught:
        plan([FULL, STATE], CacheDemand(4096, 64, 4096), kv_budget_bytes=GIB)
    message = str(caught.value)
    # a sequence's slot is 280 KiB; 1 GiB holds 3744 slots, one of them the scratch slot
    assert "--max-num-seqs 4096" in message and "lower --max-num-seqs to 3743 or less" in message
    assert "raise --kv-cache-gb" in message


def test_weights_that_cannot_fit_are_refused_before_loading():
    check_weights_fit(10 * GIB, free_bytes=40 * GIB, total_bytes=80 * GIB, utilization=0.9)
    with pytest.raises(MemoryPlanError, match="weights need 16.00 GiB"):
        check_weights_fit(16 * GIB, free_bytes=15 * GIB, total_bytes=80 * GIB, utilization=0.9)


def test_speculation_adds_snapshot_slots_to_each_state_group_before_the_kv_blocks():
    """8 sequences that may verify 3 drafts each: 8 + 24 slots (and the scratch slot), taken
    from the budget before the full-attention blocks share what is left."""
    plain = plan([FULL, STATE], CacheDemand(8, 64, 4096), kv_budget_bytes=GIB)
    speculating = plan([FULL, STATE], CacheDemand(8, 64, 4096, num_state_snapshots=24), kv_budget_bytes=GIB)
    assert plain.num_pages[1] == 8 and speculating.num_pages[1] == 32
    slot_bytes, block_bytes = speculating.bytes_per_page[1], speculating.bytes_per_page[0]
    assert speculating.num_pages[0] == (GIB - 33 * slot_bytes) // block_bytes - 1
    assert plain.num_pages[0] > speculating.num_pages[0]
    with pytest.raises(MemoryPlanError, match="and 9000 snapshot slots for drafts"):
        plan([FULL, STATE], CacheDemand(8, 64, 4096, num_state_snapshots=9000), kv_budget_bytes=GIB)
