"""The startup memory arithmetic: exact block counts, and messages that name the fix."""

import pytest

from atlas.domain.memory_plan import GIB, MemoryPlanError, check_weights_fit, plan_kv_cache


def test_kv_blocks_from_utilisation():
    plan = plan_kv_cache(
        free_bytes=60 * GIB, total_bytes=80 * GIB, utilization=0.9, reserved_bytes=2 * GIB,
        bytes_per_block=2 * 2**20, block_size=16, max_model_len=4096,
    )
    # 72 GiB usable - 20 in use - 2 reserved = 50 GiB = 25600 blocks of 2 MiB, one kept as scratch
    assert plan.num_blocks == 25599
    assert plan.num_tokens == 25599 * 16


def test_fixed_kv_budget_is_capped_by_free_memory():
    plan = plan_kv_cache(
        free_bytes=3 * GIB, total_bytes=8 * GIB, utilization=0.5, reserved_bytes=GIB,
        bytes_per_block=GIB // 4, block_size=16, max_model_len=32, kv_budget_bytes=10 * GIB,
    )
    assert plan.num_blocks == 7  # 2 GiB free after the reservation = 8 blocks, less scratch


def test_too_little_memory_says_what_fits_and_which_flags():
    with pytest.raises(MemoryPlanError) as caught:
        plan_kv_cache(
            free_bytes=10 * GIB, total_bytes=80 * GIB, utilization=0.9, reserved_bytes=0,
            bytes_per_block=GIB // 8, block_size=16, max_model_len=131072,
        )
    message = str(caught.value)
    # 72 GiB usable - 70 in use = 2 GiB = 16 blocks, one kept as scratch
    assert "15 blocks of 16 tokens" in message
    assert "--max-seq-len 240" in message and "needs 8192 blocks" in message and "--gpu-memory-utilization" in message


def test_weights_that_cannot_fit_are_refused_before_loading():
    check_weights_fit(10 * GIB, free_bytes=40 * GIB, total_bytes=80 * GIB, utilization=0.9)
    with pytest.raises(MemoryPlanError, match="weights need 16.00 GiB"):
        check_weights_fit(16 * GIB, free_bytes=15 * GIB, total_bytes=80 * GIB, utilization=0.9)
