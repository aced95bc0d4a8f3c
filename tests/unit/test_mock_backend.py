"""What only the mock does: fault injection, a memory cap, bf16 activations rounding like a GPU.
Its kinds' math is checked with every other backend's in tests/contract."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.ports.gpu import DType, Kind
from atlas.ports.kernels.attention import KvCacheSpec
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm


def _projection(backend, rng, rows=8, inner=16, activation=None):
    host = HostProjection(HostLinear(rng.standard_normal((rows, inner)).astype(np.float32)),
                          RmsNorm(np.ones(inner, np.float32), 1e-6), activation)
    return backend.dense.prepare(host)


def test_the_mock_implements_every_kind():
    assert MockGpuBackend().capabilities.kinds == frozenset(Kind)


def test_an_injected_fault_raises_until_cleared(rng):
    backend = MockGpuBackend()
    projection = _projection(backend, rng)
    x, out = backend.upload(np.ones((1, 16), np.float32)), backend.empty((1, 8), DType.F32)
    backend.inject_fault("dense.project", RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        backend.dense.project(x, projection, out)
    backend.clear_faults()
    backend.dense.project(x, projection, out)


def test_the_memory_cap_counts_tensors_weights_and_caches():
    backend = MockGpuBackend(memory_bytes=1 << 20)
    with pytest.raises(MemoryError, match="MiB free"):
        backend.empty((1 << 20,), DType.F32)
    held = backend.empty((1 << 17,), DType.F32)  # half the budget
    free_before = backend.memory_info()[0]
    del held
    assert backend.memory_info()[0] == free_before + (1 << 19)
    with pytest.raises(MemoryError, match="holds"):
        backend.attention.allocate_cache(KvCacheSpec(4, 1000, 16, 8, 64, DType.F32))
    cache = backend.attention.allocate_cache(KvCacheSpec(1, 4, 16, 2, 64, DType.F32))
    assert backend.memory_info()[0] == free_before + (1 << 19) - cache.spec.total_bytes


def test_bf16_activations_round_the_intermediates_like_a_gpu(rng):
    """In bf16 mode the norm's output and the gate/up product are rounded to bf16 before the
    activation: the result moves by bf16 rounding from the float32 mode's, not more."""
    x = rng.standard_normal((4, 32)).astype(np.float32)
    outputs = []
    for dtype in (DType.F32, DType.BF16):
        backend = MockGpuBackend(activation_dtype=dtype)
        projection = _projection(backend, np.random.default_rng(3), rows=64, inner=32, activation=Activation.SILU)
        out = backend.empty((4, 32), dtype)
        backend.dense.project(backend.upload(x, DType.BF16), projection, out)
        outputs.append(backend.download(out).astype(np.float64))
    relative = np.linalg.norm(outputs[1] - outputs[0]) / np.linalg.norm(outputs[0])
    assert 1e-4 < relative < 2e-2
