"""The two products of the wgmma prefill attention kernel, each in isolation (tests/gpu/wgmma_probe.cu
with kernels/common/wgmma.cuh), against numpy: S = Q K^T with both operands K-major in swizzled
shared-memory panels, and O = P V with P in registers and V read transposed (MN-major). A
descriptor or fragment-layout error fails here with the pattern of the wrong elements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cuda_harness import bf16, host, poisoned, rel_l2

from atlas.ports.gpu import DType

pytestmark = pytest.mark.gpu

_HERE = Path(__file__).resolve().parent
_KERNELS = _HERE.parent.parent / "kernels"


@pytest.fixture(scope="module")
def probe_code(cuda_backend):
    from cuda.core import ObjectCode, Program, ProgramOptions

    from atlas.adapters.cuda.compiler import cuda_include_dir

    if cuda_backend.runtime.compute_capability != (9, 0):
        pytest.skip("wgmma needs an sm_90a device")
    options = ProgramOptions(
        name="wgmma_probe.cu",
        arch="sm_90a",
        std="c++17",
        include_path=[str(_KERNELS / "sm90"), str(_KERNELS / "common"), str(cuda_include_dir())],
    )
    program = Program((_HERE / "wgmma_probe.cu").read_text(), "c++", options)
    try:
        return ObjectCode.from_cubin(bytes(program.compile("cubin").code), name="wgmma_probe")
    finally:
        program.close()


def _run(cuda_backend, code, symbol: str, shared_bytes: int, *addresses: int) -> None:
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch

    from atlas.adapters.cuda.driver import check

    rt = cuda_backend.runtime
    kernel = code.get_kernel(symbol)
    attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check("cuKernelSetAttribute", cu.cuKernelSetAttribute(attribute, shared_bytes, kernel.handle, rt.device.device_id))
    launch(rt.stream, LaunchConfig(grid=1, block=128, shmem_size=shared_bytes), kernel, *addresses)
    cuda_backend.synchronize()


def _pattern(actual: np.ndarray, expected: np.ndarray) -> str:
    wrong = ~np.isclose(actual, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
    rows, cols = np.nonzero(wrong)
    return (
        f"{wrong.sum()} of {wrong.size} wrong; rows {sorted(set(rows.tolist()))[:16]}, "
        f"columns {sorted(set(cols.tolist()))[:16]}"
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_product_in_swizzled_panels(cuda_backend, probe_code, rng, head_dim):
    q = bf16(rng.standard_normal((64, head_dim)))
    k = bf16(rng.standard_normal((128, head_dim)))
    out = poisoned(cuda_backend, (64, 128), DType.F32)
    q_device, k_device = cuda_backend.upload(q, DType.BF16), cuda_backend.upload(k, DType.BF16)
    shared_bytes = (64 + 128) * head_dim * 2 + 1024
    _run(
        cuda_backend, probe_code, f"probe_qk_d{head_dim}", shared_bytes, q_device.address, k_device.address, out.address
    )
    actual, expected = host(cuda_backend, out), q.astype(np.float64) @ k.astype(np.float64).T
    assert rel_l2(actual, expected) < 1e-5, _pattern(actual, expected)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pv_product_with_transposed_v(cuda_backend, probe_code, rng, head_dim):
    p = bf16(rng.random((64, 128)))
    v = bf16(rng.standard_normal((128, head_dim)))
    out = poisoned(cuda_backend, (64, head_dim), DType.F32)
    p_device, v_device = cuda_backend.upload(p, DType.BF16), cuda_backend.upload(v, DType.BF16)
    shared_bytes = 128 * head_dim * 2 + 1024
    _run(
        cuda_backend, probe_code, f"probe_pv_d{head_dim}", shared_bytes, p_device.address, v_device.address, out.address
    )
    actual, expected = host(cuda_backend, out), p.astype(np.float64) @ v.astype(np.float64)
    assert rel_l2(actual, expected) < 1e-5, _pattern(actual, expected)
