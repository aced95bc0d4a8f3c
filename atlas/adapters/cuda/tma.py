"""Tensor maps for the Hopper tensor memory accelerator (TMA), and launches that take them.

A kernel that copies with TMA (kernels/common/tma.cuh) takes a 128-byte `CUtensorMap` by value
(`const __grid_constant__ TmaMap`). The driver encodes it (`cuTensorMapEncodeTiled`); `TensorMap`
holds its bytes, and `CudaRuntime.launch` passes kernels that take one through
`cuLaunchKernelEx` with a parameter array it builds itself, since cuda.core's argument packing
has no 128-byte struct.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import check

TENSOR_MAP_BYTES = 128


@dataclass(frozen=True, slots=True)
class TensorMap:
    """The encoded bytes of one CUtensorMap."""

    raw: bytes

    def as_parameter(self) -> ctypes.Array:
        return (ctypes.c_ubyte * TENSOR_MAP_BYTES).from_buffer_copy(self.raw)


def bf16_rows_map(address: int, rows: int, width: int, box_rows: int, box_width: int = 64) -> TensorMap:
    """A map of a row-major bf16 matrix [rows, width] read in boxes of [box_rows][box_width]
    elements, 128-byte swizzled (box_width * 2 must be 128 bytes or less) as wgmma's shared-memory
    panels want (wgmma.cuh); parts of a box past the matrix arrive as zeros. The address must be
    16-byte aligned and the width a multiple of 8 (16-byte row pitch)."""
    if address % 16 or width % 8:
        raise ValueError(f"TMA needs 16-byte aligned rows: address {address:#x}, width {width}")
    if box_width * 2 > 128 or not 0 < box_rows <= 256:
        raise ValueError(f"box [{box_rows}][{box_width}] does not fit a 128-byte swizzle")
    tensor_map = check(
        "cuTensorMapEncodeTiled",
        cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            cu.cuuint32_t(2),
            address,
            [cu.cuuint64_t(width), cu.cuuint64_t(rows)],  # innermost first
            [cu.cuuint64_t(width * 2)],  # bytes between rows
            [cu.cuuint32_t(box_width), cu.cuuint32_t(box_rows)],
            [cu.cuuint32_t(1), cu.cuuint32_t(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
    )
    return TensorMap(ctypes.string_at(int(tensor_map.getPtr()), TENSOR_MAP_BYTES))


_SCALARS = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.float32): ctypes.c_float,
}


def parameter_array(args: tuple) -> tuple[ctypes.Array, list]:
    """The `void**` kernel-parameter array for `args` (device addresses as ints, numpy scalars,
    TensorMaps), and the values it points to (keep them alive until the launch returns)."""
    values: list = []
    for arg in args:
        if isinstance(arg, TensorMap):
            values.append(arg.as_parameter())
        elif isinstance(arg, int):
            values.append(ctypes.c_uint64(arg))  # a device address
        elif isinstance(arg, np.generic) and arg.dtype in _SCALARS:
            values.append(_SCALARS[arg.dtype](arg.item()))
        else:
            raise TypeError(f"kernel argument of type {type(arg).__name__} cannot be passed")
    pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
    return pointers, values
