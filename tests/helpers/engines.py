"""Wiring a loaded model into a worker and a cache manager by hand, as the builder does, with
exact page counts (tests choose them; the builder asks the memory plan)."""

from __future__ import annotations

from atlas.domain.cache.manager import CacheManager
from atlas.domain.device_caches import allocate_caches
from atlas.domain.models.model import Model
from atlas.domain.worker import Worker, WorkerConfig
from atlas.ports.gpu import DType


def page_counts(model: Model, num_blocks: int, num_slots: int = 16) -> tuple[int, ...]:
    """`num_blocks` blocks for every KV group, `num_slots` state slots for every recurrent one."""
    return tuple(num_blocks if group.kind.is_kv else num_slots for group in model.cache_groups)


def make_worker(
    model: Model,
    num_blocks: int,
    block_size: int,
    config: WorkerConfig,
    kv_dtype: DType = DType.F32,
    kv_scales: tuple[tuple[float, float], ...] = (),
    num_slots: int | None = None,
) -> Worker:
    """A worker over caches of `num_blocks` usable blocks per KV group (and `num_slots`, default
    `config.max_num_seqs`, state slots per recurrent group), each with its scratch page."""
    pages = page_counts(model, num_blocks, num_slots if num_slots is not None else config.max_num_seqs)
    caches = allocate_caches(model.backend, model.cache_groups, pages, block_size, kv_dtype, kv_scales)
    return Worker(model.backend, model, caches, config)


def make_cache(model: Model, num_blocks: int, block_size: int, num_slots: int, prefix_caching: bool = True) -> CacheManager:
    """The cache manager over the model's groups with the pools `make_worker`'s caches back."""
    return CacheManager.for_groups(model.cache_groups, page_counts(model, num_blocks, num_slots), block_size, prefix_caching)
