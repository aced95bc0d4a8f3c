"""A model's caches on a device: one per cache group, each with a scratch page past its pool's.

    group's pool (the cache manager)    pages 0 .. n - 1      handed to sequences
    device cache (this module)          pages 0 .. n          page n: the scratch page

A KV group's cache holds n + 1 blocks and a recurrent group's n + 1 state slots. The scratch
page is where a captured decode graph's padding rows write (their K/V, their state): the pool
never hands it out, so no sequence reads what they leave. It is also what unused entries of a
step's block tables point at. This module is the one place that knows it is the last page.
"""

from __future__ import annotations

from collections.abc import Sequence

from atlas.domain.models.cache_groups import CacheGroupSpec
from atlas.ports.gpu import DType, GpuBackend
from atlas.ports.kernels.attention import KvCache, KvCacheSpec
from atlas.ports.kernels.recurrent import RecurrentState

DeviceCache = KvCache | RecurrentState

SCRATCH_PAGES = 1


def device_pages(num_pages: int) -> int:
    """Pages a device cache holds for a pool of `num_pages`: the scratch page besides."""
    return num_pages + SCRATCH_PAGES


def allocate_caches(
    backend: GpuBackend,
    groups: Sequence[CacheGroupSpec],
    num_pages: Sequence[int],
    block_size: int,
    kv_dtype: DType,
    kv_scales: Sequence[tuple[float, float]] = (),
) -> tuple[DeviceCache, ...]:
    """One device cache per group, in order: `allocate_cache` for a KV group (blocks of
    `block_size` tokens of `kv_dtype`; `kv_scales`: per model layer, for an FP8 cache), and
    `allocate_state` for a recurrent group, each with `device_pages(num_pages[i])` pages.
    Raises ValueError when the counts do not match the groups, and the backends' MemoryError."""
    if len(num_pages) != len(groups):
        raise ValueError(f"{len(num_pages)} page counts for {len(groups)} cache groups")
    caches: list[DeviceCache] = []
    for group, count in zip(groups, num_pages, strict=True):
        if group.kind.is_kv:
            scales = tuple(kv_scales[layer] for layer in group.layers) if kv_scales else ()
            spec = group.kv_cache_spec(device_pages(count), block_size, kv_dtype, scales)
            caches.append(backend.attention.allocate_cache(spec))
        else:
            caches.append(backend.recurrent.allocate_state(group.state_spec(device_pages(count))))
    return tuple(caches)


def scratch_page(cache: DeviceCache) -> int:
    """The scratch page of a cache made by `allocate_caches`: its last block or slot."""
    spec = cache.spec
    return (spec.num_blocks if isinstance(spec, KvCacheSpec) else spec.num_slots) - SCRATCH_PAGES
