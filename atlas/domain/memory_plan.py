"""How many KV blocks fit: the startup memory arithmetic, pure so it is tested exactly.

    device memory (total)
    |<---------------- total * gpu_memory_utilization ---------------->|<- left alone ->|
    |  in use before us  |  weights  |  workspace  |  KV cache blocks   |
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


class MemoryPlanError(ValueError):
    """The model does not fit; the message says what would and which flag to change."""


@dataclass(frozen=True, slots=True)
class KvPlan:
    num_blocks: int  # usable blocks (the pool's size; the cache holds one more as scratch)
    bytes_per_block: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def check_weights_fit(weight_bytes: int, free_bytes: int, total_bytes: int, utilization: float) -> None:
    """Before loading: refuse early when the weights alone exceed the usable memory."""
    usable = min(free_bytes, int(total_bytes * utilization) - (total_bytes - free_bytes))
    if weight_bytes > usable:
        raise MemoryPlanError(
            f"the weights need {weight_bytes / GIB:.2f} GiB but only {max(usable, 0) / GIB:.2f} GiB is usable "
            f"({free_bytes / GIB:.2f} GiB free of {total_bytes / GIB:.2f} GiB at --gpu-memory-utilization "
            f"{utilization}); free the device or use a smaller model"
        )


def plan_kv_cache(
    *,
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    reserved_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    kv_budget_bytes: int | None = None,
) -> KvPlan:
    """Blocks for the KV cache once weights are loaded (`free_bytes` measured after loading).

    `reserved_bytes` is memory still to be allocated (workspace, step buffers). With
    `kv_budget_bytes` the cache gets that much (if free) instead of the utilisation rule.
    Raises MemoryPlanError when not even one sequence of `max_model_len` tokens fits.
    """
    available = free_bytes - reserved_bytes
    if kv_budget_bytes is not None:
        budget = min(kv_budget_bytes, available)
        flag_hint = "raise --kv-cache-gb"
    else:
        in_use = total_bytes - free_bytes
        budget = min(int(total_bytes * utilization) - in_use - reserved_bytes, available)
        flag_hint = "raise --gpu-memory-utilization"
    # one block is kept back as the scratch page for padded graph rows
    num_blocks = max(budget // bytes_per_block - 1, 0)
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        fits_tokens = num_blocks * block_size
        raise MemoryPlanError(
            f"the KV cache can hold {num_blocks} blocks of {block_size} tokens ({fits_tokens} tokens, "
            f"{max(budget, 0) / GIB:.2f} GiB) but one sequence of --max-seq-len {max_model_len} needs {needed} "
            f"blocks; set --max-seq-len {max(fits_tokens, 0)} or less, or {flag_hint}"
        )
    return KvPlan(num_blocks=num_blocks, bytes_per_block=bytes_per_block, block_size=block_size)
