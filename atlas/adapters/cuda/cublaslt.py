"""bf16 GEMMs through cuBLASLt (`nvmath.bindings.cublasLt`) for the prefill-sized `linear`.

out[N, M] = x[N, K] @ w[M, K]^T (+ bias[M]) in row-major terms is, in cuBLAS's column-major
terms, D[M, N] = op(A)[M, K] @ B[K, N] with A = w seen as a K x M matrix (ld K, transposed) and
B = x seen as K x N (ld K):

    row-major w [M, K]  ==  column-major A [K, M]   ->  op(A) = A^T  [M, K]
    row-major x [N, K]  ==  column-major B [K, N]
    row-major out [N, M] == column-major D [M, N]   (ld M)

A plan (descriptors, layouts and the heuristic's algorithm) is built once per shape and reused;
the workspace is persistent so the call can be captured in a graph. fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from nvmath.bindings import cublas
from nvmath.bindings import cublasLt as lt

from atlas.ports.gpu import DType

_DATA_TYPES = {DType.BF16: 14, DType.F16: 2, DType.F32: 0}  # cudaDataType: CUDA_R_16BF, _16F, _32F
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20


@dataclass(slots=True)
class _Plan:
    descriptor: int
    layouts: tuple[int, int, int]
    heuristic: np.ndarray  # keeps the algorithm struct alive; its address is passed to matmul
    bias_attribute: np.ndarray | None


class CublasLtGemm:
    """Cached cuBLASLt plans over one handle, stream and workspace."""

    def __init__(self, stream_handle: int, workspace_address: int) -> None:
        self._handle = lt.create()
        self._stream = stream_handle
        self._workspace = workspace_address
        self._plans: dict[tuple, _Plan] = {}
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)

    def matmul(
        self,
        x_address: int,
        w_address: int,
        out_address: int,
        num_tokens: int,
        num_rows: int,
        inner: int,
        in_dtype: DType,
        out_dtype: DType,
        bias_address: int | None = None,
    ) -> None:
        """Enqueue out = x @ w^T (+ bias) on the stream. Raises `RuntimeError` when cuBLASLt
        has no algorithm for the shape (the message names it)."""
        key = (num_tokens, num_rows, inner, in_dtype, out_dtype, bias_address is not None)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build(num_tokens, num_rows, inner, in_dtype, out_dtype, bias_address is not None)
            self._plans[key] = plan
        if plan.bias_attribute is not None:
            plan.bias_attribute[0] = bias_address
            lt.matmul_desc_set_attribute(
                plan.descriptor,
                lt.MatmulDescAttribute.BIAS_POINTER,
                plan.bias_attribute.ctypes.data,
                plan.bias_attribute.itemsize,
            )
        a_layout, b_layout, d_layout = plan.layouts
        lt.matmul(
            self._handle,
            plan.descriptor,
            self._alpha.ctypes.data,
            w_address,
            a_layout,
            x_address,
            b_layout,
            self._beta.ctypes.data,
            out_address,
            d_layout,
            out_address,
            d_layout,
            plan.heuristic.ctypes.data,
            self._workspace,
            WORKSPACE_BYTES,
            self._stream,
        )

    def _build(
        self, num_tokens: int, num_rows: int, inner: int, in_dtype: DType, out_dtype: DType, with_bias: bool
    ) -> _Plan:
        descriptor = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), _DATA_TYPES[DType.F32])
        _set(descriptor, lt.MatmulDescAttribute.TRANSA, _OP_T)
        _set(descriptor, lt.MatmulDescAttribute.TRANSB, _OP_N)
        bias_attribute = None
        if with_bias:
            _set(descriptor, lt.MatmulDescAttribute.EPILOGUE, int(lt.Epilogue.BIAS))
            bias_dtype = lt.get_matmul_desc_attribute_dtype(lt.MatmulDescAttribute.BIAS_POINTER)
            bias_attribute = np.zeros(1, dtype=bias_dtype)
        a_layout = lt.matrix_layout_create(_DATA_TYPES[in_dtype], inner, num_rows, inner)
        b_layout = lt.matrix_layout_create(_DATA_TYPES[in_dtype], inner, num_tokens, inner)
        d_layout = lt.matrix_layout_create(_DATA_TYPES[out_dtype], num_rows, num_tokens, num_rows)

        preference = lt.matmul_preference_create()
        workspace_limit = np.array([WORKSPACE_BYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(
            preference,
            lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
            workspace_limit.ctypes.data,
            workspace_limit.itemsize,
        )
        heuristic = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        found = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(
            self._handle,
            descriptor,
            a_layout,
            b_layout,
            d_layout,
            d_layout,
            preference,
            1,
            heuristic.ctypes.data,
            found.ctypes.data,
        )
        lt.matmul_preference_destroy(preference)
        if found[0] < 1:
            raise RuntimeError(
                f"cuBLASLt has no algorithm for x [{num_tokens}, {inner}] @ w [{num_rows}, {inner}]^T "
                f"({in_dtype.value} -> {out_dtype.value})"
            )
        return _Plan(descriptor, (a_layout, b_layout, d_layout), heuristic, bias_attribute)

    def close(self) -> None:
        for plan in self._plans.values():
            for layout in plan.layouts:
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(plan.descriptor)
        self._plans.clear()
        lt.destroy(self._handle)


def _set(descriptor: int, attribute: lt.MatmulDescAttribute, value: int) -> None:
    buffer = np.array([value], dtype=lt.get_matmul_desc_attribute_dtype(attribute))
    lt.matmul_desc_set_attribute(descriptor, attribute, buffer.ctypes.data, buffer.itemsize)
