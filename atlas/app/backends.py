"""Choosing the device backend. The CUDA adapter is imported only when it is asked for."""

from __future__ import annotations

import logging

from atlas.app.settings import SettingsError
from atlas.ports.gpu import DType, GpuBackend

log = logging.getLogger("atlas")


def cuda_available() -> bool:
    """True when the `cuda` extra is installed and a GPU answers; never raises."""
    try:
        from atlas.adapters import cuda
    except ImportError:
        return False
    return cuda.available()


def make_backend(device: str, model_type: str | None = None, dtype: str = "auto",
                 batch_invariant: bool = False) -> GpuBackend:
    """`mock`, `cuda`, or `auto` (CUDA when a GPU and the `cuda` extra are present).

    `dtype` is the activation type: the mock computes in f32 by default and rounds like a GPU
    with bf16; CUDA runs bf16 only. `batch_invariant` (CUDA only; see
    `CudaFeatures.batch_invariant`): a token row's bits do not depend on the other rows of its step.
    """
    if device == "mock" or (device == "auto" and not cuda_available()):
        from atlas.adapters.mock.backend import MockGpuBackend

        if device == "auto":
            log.info("no CUDA GPU (or the cuda extra is not installed): using the mock backend (numpy on the CPU)")
        return MockGpuBackend(activation_dtype=DType.BF16 if dtype == "bf16" else DType.F32)
    if dtype == "f32":
        raise SettingsError("--dtype f32 runs only on the mock backend; the CUDA kernels compute in bf16")
    if not cuda_available():
        raise SettingsError(
            "--device cuda needs an NVIDIA GPU and the cuda extra (pip install -e '.[cuda]'); "
            "use --device mock to run on the CPU"
        )
    from atlas.adapters.cuda import CudaGpuBackend

    return CudaGpuBackend(model_hint=model_type, batch_invariant=batch_invariant)
