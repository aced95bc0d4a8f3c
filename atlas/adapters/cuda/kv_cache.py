"""The paged KV cache in device memory.

One allocation holds every layer's K and V pages:

    planes [num_layers][2: K, V][num_blocks][page]
    page   [num_kv_heads][block_size][head_dim]        (contiguous, head-major)

    slot s = block * block_size + offset
    element (layer, K|V, slot, head, d) =
        ((((layer * 2 + kv) * num_blocks + block) * num_kv_heads + head) * block_size + offset) * head_dim + d

Head-major pages keep each head's `block_size x head_dim` tile contiguous, so attention reads
whole 16-byte rows of one head and a page copy is one flat copy per plane.
"""

from __future__ import annotations

import numpy as np

from atlas.adapters.cuda.memory import DeviceAllocation
from atlas.ports.kernels.attention import KvCacheSpec


class CudaKvCache:
    __slots__ = ("_spec", "_allocation", "base_address", "page_bytes", "plane_bytes")

    def __init__(self, spec: KvCacheSpec, allocation: DeviceAllocation) -> None:
        self._spec = spec
        self._allocation = allocation
        self.base_address = allocation.address
        self.page_bytes = spec.block_size * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        self.plane_bytes = spec.num_blocks * self.page_bytes

    @property
    def spec(self) -> KvCacheSpec:
        return self._spec

    def key_plane(self, layer: int) -> int:
        """Device address of layer `layer`'s K pages."""
        self._check_layer(layer)
        return self.base_address + (2 * layer) * self.plane_bytes

    def value_plane(self, layer: int) -> int:
        self._check_layer(layer)
        return self.base_address + (2 * layer + 1) * self.plane_bytes

    def plane_to_slots(self, plane: np.ndarray) -> np.ndarray:
        """[num_blocks, Hkv, block_size, D] as read from a plane -> [num_blocks, block_size, Hkv, D]."""
        spec = self._spec
        return plane.reshape(spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim).transpose(0, 2, 1, 3)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._spec.num_layers:
            raise ValueError(f"layer: {layer} is outside [0, {self._spec.num_layers})")
