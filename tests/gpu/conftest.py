"""Fixtures for the CUDA backend tests. GPU tests skip cleanly without a GPU or the cuda extra.

The kernel cache of the session goes to a temporary folder unless ATLAS_KERNEL_CACHE is set,
so a test run never depends on (or pollutes) the user's cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cuda_harness import MockReference, cuda_test_backend


def _require_cuda() -> None:
    pytest.importorskip("cuda.core", reason="the cuda extra is not installed")
    pytest.importorskip("nvmath", reason="the cuda extra is not installed (nvmath-python)")
    from atlas.adapters import cuda

    if not cuda.available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("ATLAS_KERNEL_CACHE")
    return Path(configured) if configured else tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def cuda_backend(kernel_cache_dir: Path):
    """A `CudaTestBackend`: the CUDA backend plus an entry point per internal op path."""
    _require_cuda()
    backend = cuda_test_backend(kernel_cache_dir)
    yield backend
    backend.synchronize()


@pytest.fixture(scope="session")
def mock_backend() -> MockReference:
    return MockReference()
