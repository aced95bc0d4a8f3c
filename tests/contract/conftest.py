"""The contract suite: every kind's members against float64 numpy references, on every backend
available here. The mock runs always; CUDA (marked `gpu`) where the cuda extra imports and a GPU
answers. A new backend adds its `Harness` (contract_harness.py) here and runs the suite unchanged.

A harness knows what the port leaves to the backend: how to read a KV cache back and seed one
(the page layout), and how close its float outputs come (bf16 activations round).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from contract_harness import Harness

from atlas.ports.gpu import DType


def _cuda_harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    pytest.importorskip("cuda.core", reason="the cuda extra is not installed")
    pytest.importorskip("nvmath", reason="the cuda extra is not installed (nvmath-python)")
    from atlas.adapters import cuda

    if not cuda.available():
        pytest.skip("no CUDA GPU")
    configured = os.environ.get("ATLAS_KERNEL_CACHE")
    cache_dir = Path(configured) if configured else tmp_path_factory.mktemp("kernel-cache")
    return Harness("cuda", cuda.CudaGpuBackend(kernel_cache_dir=cache_dir), tolerance=1e-2, fp8_tolerance=6e-2)


_HARNESSES: dict[str, Harness] = {}


@pytest.fixture(params=["mock", pytest.param("cuda", marks=pytest.mark.gpu)], scope="session")
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    if request.param not in _HARNESSES:
        if request.param == "mock":
            from atlas.adapters.mock.backend import MockGpuBackend

            _HARNESSES["mock"] = Harness("mock", MockGpuBackend(activation_dtype=DType.F32), tolerance=1e-5)
        else:
            _HARNESSES["cuda"] = _cuda_harness(tmp_path_factory)
    return _HARNESSES[request.param]
