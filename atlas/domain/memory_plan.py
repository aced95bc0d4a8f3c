"""How many cache pages fit: the startup memory arithmetic, pure so it is tested exactly.

    device memory (total)
    |<---------------- total * gpu_memory_utilization ---------------->|<- left alone ->|
    |  in use before us  |  weights  |  workspace  |  cache budget      |

The cache budget is split between a model's cache groups (`CacheGroupSpec`), each page of a
group's device cache costing `bytes_per_page` (one more page than its pool hands out: the
scratch page, `atlas.domain.device_caches`):

1. Recurrent-state groups first: one slot per sequence that may run (`--max-num-seqs`), and
   with speculation one snapshot slot per draft of each sequence that may verify drafts.
2. Full-attention groups share the rest with equal block counts N: every sequence holds as many
   blocks in each, so their bytes go as the layers (and page size) each covers.
3. Sliding-window groups get min(N, what their windows need): the window of every running
   sequence plus one step's new tokens, S * window_pages(1) + ceil(T / B), and never fewer than
   one sequence's largest step, window_pages(T). A model with no full-attention group has
   nothing to bound its windows' blocks by N, so there they share the budget like full ones.

N is the largest count whose pages fit. A model whose full-attention groups cannot hold one
sequence of `--max-seq-len`, or whose state slots alone exceed the budget, is refused with what
would fit and the flag to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from atlas.domain.cache.groups import window_pages
from atlas.domain.device_caches import device_pages
from atlas.domain.models.cache_groups import CacheGroupKind, CacheGroupSpec
from atlas.ports.gpu import DType

GIB = 2**30


class MemoryPlanError(ValueError):
    """The model does not fit; the message says what would and which flag to change."""


@dataclass(frozen=True, slots=True)
class CachePlan:
    """Pages per cache group (in the model's order): what each group's pool hands out, KV blocks
    of `block_size` tokens or state slots. Each device cache holds one more (its scratch page)."""

    num_pages: tuple[int, ...]
    bytes_per_page: tuple[int, ...]
    block_size: int

    @property
    def total_bytes(self) -> int:
        """Device bytes of every group's cache, scratch pages included."""
        return sum(device_pages(n) * size for n, size in zip(self.num_pages, self.bytes_per_page, strict=True))


@dataclass(frozen=True, slots=True)
class CacheDemand:
    """What the engine asks of the cache: S sequences at once, T tokens a step, L tokens long,
    and the snapshot slots each recurrent group needs besides S for the drafts a step verifies
    (`StateSlotGroup`: k per sequence that may speculate)."""

    max_num_seqs: int
    max_step_tokens: int
    max_model_len: int
    num_state_snapshots: int = 0

    @property
    def num_state_slots(self) -> int:
        """Pages of each recurrent-state group: a slot per sequence, and the snapshots."""
        return self.max_num_seqs + self.num_state_snapshots


def check_weights_fit(weight_bytes: int, free_bytes: int, total_bytes: int, utilization: float) -> None:
    """Before loading: refuse early when the weights alone exceed the usable memory."""
    usable = min(free_bytes, int(total_bytes * utilization) - (total_bytes - free_bytes))
    if weight_bytes > usable:
        raise MemoryPlanError(
            f"the weights need {weight_bytes / GIB:.2f} GiB but only {max(usable, 0) / GIB:.2f} GiB is usable "
            f"({free_bytes / GIB:.2f} GiB free of {total_bytes / GIB:.2f} GiB at --gpu-memory-utilization "
            f"{utilization}); free the device or use a smaller model"
        )


def plan_cache(
    *,
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    reserved_bytes: int,
    groups: Sequence[CacheGroupSpec],
    kv_dtype: DType,
    block_size: int,
    demand: CacheDemand,
    kv_budget_bytes: int | None = None,
) -> CachePlan:
    """Pages for every cache group once weights are loaded (`free_bytes` measured after loading).

    `reserved_bytes` is memory still to be allocated (workspace, step buffers). With
    `kv_budget_bytes` the caches get that much (if free) instead of the utilisation rule.
    Raises MemoryPlanError when the state slots or one sequence of `max_model_len` do not fit.
    """
    available = free_bytes - reserved_bytes
    if kv_budget_bytes is not None:
        budget = min(kv_budget_bytes, available)
        flag_hint = "raise --kv-cache-gb"
    else:
        budget = min(int(total_bytes * utilization) - (total_bytes - free_bytes) - reserved_bytes, available)
        flag_hint = "raise --gpu-memory-utilization"
    sizes = tuple(group.bytes_per_page(block_size, kv_dtype) for group in groups)
    num_slots = demand.num_state_slots
    state_bytes = sum(device_pages(num_slots) * size for group, size in zip(groups, sizes) if not group.kind.is_kv)
    if state_bytes > budget:
        per_slot = state_bytes // device_pages(num_slots)
        snapshots = f" and {demand.num_state_snapshots} snapshot slots for drafts" if demand.num_state_snapshots else ""
        seqs_fit = max((budget // per_slot - 1) * demand.max_num_seqs // num_slots, 0)
        raise MemoryPlanError(
            f"the recurrent state of --max-num-seqs {demand.max_num_seqs} sequences{snapshots} needs "
            f"{state_bytes / GIB:.2f} GiB ({per_slot / 2**20:.1f} MiB a slot) but the cache has "
            f"{max(budget, 0) / GIB:.2f} GiB; lower --max-num-seqs to {seqs_fit} or less, or {flag_hint}"
        )
    bounds = _page_bounds(groups, block_size, demand)
    kv_budget = budget - state_bytes

    def kv_bytes(count: int) -> int:
        return sum(device_pages(n) * size for n, size in zip(_pages(bounds, count), sizes, strict=True) if n is not None)

    low, high = 0, max(kv_budget, 0) // min(sizes) + 1  # kv_bytes(high) > kv_budget
    while low < high:  # the largest count that fits (kv_bytes grows with it)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if kv_bytes(middle) <= kv_budget else (low, middle - 1)
    if kv_bytes(low) > kv_budget:  # not even one sequence's step of the sliding windows
        raise MemoryPlanError(
            f"the KV cache has {max(kv_budget, 0) / GIB:.2f} GiB but its sliding-window layers need "
            f"{kv_bytes(0) / GIB:.2f} GiB for one sequence's step of --max-prefill-tokens {demand.max_step_tokens}; "
            f"lower --max-prefill-tokens, or {flag_hint}"
        )
    needed = -(-demand.max_model_len // block_size)
    if any(group.kind is CacheGroupKind.FULL_ATTENTION for group in groups) and low < needed:
        fits_tokens = low * block_size
        raise MemoryPlanError(
            f"the KV cache can hold {low} blocks of {block_size} tokens ({fits_tokens} tokens, "
            f"{max(kv_budget, 0) / GIB:.2f} GiB) but one sequence of --max-seq-len {demand.max_model_len} needs "
            f"{needed} blocks; set --max-seq-len {fits_tokens} or less, or {flag_hint}"
        )
    counts = tuple(num_slots if n is None else n for n in _pages(bounds, low))
    return CachePlan(num_pages=counts, bytes_per_page=sizes, block_size=block_size)


_UNBOUNDED = (0, None)  # a full-attention group's bounds: it gets N blocks, whatever N


def _page_bounds(
    groups: Sequence[CacheGroupSpec], block_size: int, demand: CacheDemand
) -> list[tuple[int, int | None] | None]:
    """Per group, the (fewest, most) pages it takes whatever N is (most None: no bound), or None
    for a state group, whose slots are fixed."""
    has_full = any(group.kind is CacheGroupKind.FULL_ATTENTION for group in groups)
    bounds: list[tuple[int, int | None] | None] = []
    for group in groups:
        window = group.window
        if not group.kind.is_kv:
            bounds.append(None)
        elif window is None:
            bounds.append(_UNBOUNDED)
        else:
            fewest = window_pages(window, demand.max_step_tokens, block_size)
            windows = demand.max_num_seqs * window_pages(window, 1, block_size)
            most = windows + -(-demand.max_step_tokens // block_size) if has_full else None
            bounds.append((fewest, most))
    return bounds


def _pages(bounds: Sequence[tuple[int, int | None] | None], count: int) -> tuple[int | None, ...]:
    """Each group's pages when the full-attention groups get `count` blocks (None: a state group)."""
    return tuple(
        None if bound is None else max(bound[0], count if bound[1] is None else min(count, bound[1]))
        for bound in bounds
    )
