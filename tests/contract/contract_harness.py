"""The contract suite's view of a backend: what the port leaves to it (see conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from atlas.ports.gpu import DType, GpuBackend, Kind, UnsupportedError


@dataclass
class Harness:
    name: str
    backend: GpuBackend
    tolerance: float  # relative L2 error of a float output against the float64 reference
    # ... of a projection over FP8 weights: a backend may round x to E4M3 for FP8 tensor cores
    # (3 mantissa bits: ~2.5% of a product, ~4% of a gated one; tests/gpu/test_cuda_fp8_weights.py)
    fp8_tolerance: float = 0.0

    def __post_init__(self) -> None:
        self.fp8_tolerance = max(self.fp8_tolerance, self.tolerance)

    @property
    def act(self) -> DType:
        return self.backend.capabilities.activation_dtype

    def poisoned(self, shape: tuple[int, ...], dtype: DType | None = None):
        """An output tensor full of NaN (floats) or -7 (integers): a member must write it all."""
        dtype = dtype or self.act
        fill = np.nan if dtype.is_float else -7
        return self.backend.upload(np.full(shape, fill, np.float32 if dtype.is_float else np.int64), dtype)

    def host(self, tensor) -> np.ndarray:
        return np.asarray(self.fetch(tensor), np.float64 if tensor.dtype.is_float else np.int64)

    def fetch(self, tensor) -> np.ndarray:
        """The tensor's contents as the device protocol hands them back."""
        return self.backend.begin_download(tensor).wait()

    def read_cache(self, kv, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of `layer` as float64 [num_slots, Hkv, D] (FP8 bytes as their E4M3 values)."""
        if self.name == "mock":
            keys, values = kv.to_host(layer)
        else:
            keys, values = self.backend.kv_to_host(kv, layer)
        spec = kv.spec
        shape = (spec.num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        return np.asarray(keys, np.float64).reshape(shape), np.asarray(values, np.float64).reshape(shape)

    def write_cache(self, kv, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store slot-major [num_slots, Hkv, D] K and V (already in the cache's dtype's values)."""
        if self.name == "mock":
            kv.keys[layer], kv.values[layer] = keys, values
        else:
            self.backend.kv_from_host(kv, layer, keys, values)


def prepared_or_skip(prepare, *args):
    """`prepare(*args)`, or skip the case where the backend says it cannot run that data
    (`UnsupportedError`): the gap shows in the report instead of failing the suite."""
    try:
        return prepare(*args)
    except UnsupportedError as error:
        pytest.skip(f"not supported by this backend: {error}")


def require_kind(harness: Harness, kind: Kind) -> None:
    """Skip where the backend does not list `kind` in its capabilities (it is then refused at
    load for a model that needs it; there is nothing to check here)."""
    if kind not in harness.backend.capabilities.kinds:
        pytest.skip(f"the {harness.name} backend implements no {kind.value} kernels")
