"""The CUDA adapter: `CudaGpuBackend` on an NVIDIA GPU through cuda-python.

Importing this package imports no CUDA library: `available()` checks lazily, and
`CudaGpuBackend`, `describe_kernels` and the rest load their modules on first use, so the
CPU-only install (without the `cuda` extra) can import it, ask, and move on.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from atlas.adapters.cuda.registry import KernelChoice

if TYPE_CHECKING:
    from atlas.adapters.cuda.backend import CudaGpuBackend

__all__ = ["CudaGpuBackend", "KernelChoice", "available", "describe_kernels", "device_count"]

_REQUIRED_MODULES = ("cuda.core", "cuda.bindings", "nvmath")


def available() -> bool:
    """True when the `cuda` extra is installed and the driver reports at least one GPU.

    Never raises: a missing package, a missing driver or a driver error all give False.
    """
    try:
        # The top-level names first: looking up "cuda.core" would import the "cuda" package.
        if any(importlib.util.find_spec(name.split(".")[0]) is None for name in _REQUIRED_MODULES):
            return False
        if any(importlib.util.find_spec(name) is None for name in _REQUIRED_MODULES):
            return False
    except (ImportError, ValueError):
        return False
    try:
        from cuda.bindings import driver as cu

        (init_result,) = cu.cuInit(0)
        if init_result != cu.CUresult.CUDA_SUCCESS:
            return False
        count_result, count = cu.cuDeviceGetCount()
        return count_result == cu.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # a broken driver install must not break backend selection
        return False


def device_count() -> int:
    """GPUs the driver reports (0 without a driver or the `cuda` extra); never raises."""
    if not available():
        return 0
    from cuda.bindings import driver as cu

    result, count = cu.cuDeviceGetCount()
    return int(count) if result == cu.CUresult.CUDA_SUCCESS else 0


def describe_kernels(
    model_type: str,
    quant: str = "bf16",
    device_ordinal: int = 0,
    compute_capability: tuple[int, int] | None = None,
) -> list[KernelChoice]:
    """Which kernel source serves each module for `model_type` on a device, and why.

    The device's compute capability is read from `device_ordinal` unless given (then no GPU is
    needed). `cached` says whether the module needs no compiling (a packaged cubin matches its
    source, or the disk cache holds it; None when NVRTC is not installed to compute the key).
    Raises `KernelRegistryError` for a malformed KERNELS.toml.
    """
    from atlas.adapters.cuda.registry import KernelTarget, arch_family, describe, nvrtc_arch, select_modules

    if compute_capability is None:
        compute_capability = _compute_capability(device_ordinal)
    target = KernelTarget(arch_family(compute_capability), model_type, quant)
    modules = select_modules(target)
    arch = nvrtc_arch(compute_capability)
    from atlas.adapters.cuda.compiler import KernelCompiler, packaged_cubins

    compiler = KernelCompiler(arch, packaged=packaged_cubins(arch, _driver_cuda_version()))
    return [
        KernelChoice(
            name=module.name,
            source_path=str(module.source_path),
            reason=describe(module),
            cached=_is_cached(compiler, module),
        )
        for module in modules.values()
    ]


def _is_cached(compiler, module) -> bool | None:
    """Packaged or in the disk cache; None when that is unknown (no NVRTC to key the cache)."""
    try:
        return compiler.is_cached(module)
    except Exception:  # no NVRTC (or a broken one): the cache key cannot be computed
        return None


def _driver_cuda_version() -> int | None:
    """The CUDA version the driver supports (13000 for 13.0); None without a driver."""
    try:
        from cuda.bindings import driver as cu

        result, version = cu.cuDriverGetVersion()
        return int(version) if result == cu.CUresult.CUDA_SUCCESS else None
    except Exception:  # no cuda extra or no driver: whether packaged cubins load is unknown
        return None


def _compute_capability(device_ordinal: int) -> tuple[int, int]:
    from cuda.bindings import driver as cu

    from atlas.adapters.cuda.driver import check

    check("cuInit", cu.cuInit(0))
    device = check("cuDeviceGet", cu.cuDeviceGet(device_ordinal))
    major_attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    minor_attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
    major = check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(major_attribute, device))
    minor = check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(minor_attribute, device))
    return int(major), int(minor)


def __getattr__(name: str) -> object:
    if name == "CudaGpuBackend":
        from atlas.adapters.cuda.backend import CudaGpuBackend

        return CudaGpuBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
