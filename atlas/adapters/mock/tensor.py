"""Host-memory tensors for the mock backend: numpy arrays with the port's dtype names."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from atlas.ports.gpu import DType

NUMPY_DTYPES: dict[DType, np.dtype] = {
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F16: np.dtype(np.float16),
    DType.F32: np.dtype(np.float32),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
}


def dtype_of(array: np.ndarray) -> DType:
    for dtype, np_dtype in NUMPY_DTYPES.items():
        if array.dtype == np_dtype:
            return dtype
    raise ValueError(f"no backend dtype for numpy dtype {array.dtype}")


class MockTensor:
    """A dense array in host memory. Views share memory with their base, as on a device."""

    __slots__ = ("data", "_dtype", "_f32_cache")

    def __init__(self, data: np.ndarray, dtype: DType) -> None:
        self.data = data
        self._dtype = dtype
        self._f32_cache: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> DType:
        return self._dtype

    def view(self, *shape: int) -> MockTensor:
        if int(np.prod(shape)) != self.data.size:
            raise ValueError(f"cannot view {self.shape} as {shape}")
        return MockTensor(self.data.reshape(shape), self._dtype)

    def rows(self, start: int, stop: int) -> MockTensor:
        if not 0 <= start <= stop <= self.data.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) out of range for {self.shape}")
        return MockTensor(self.data[start:stop], self._dtype)

    def as_f32(self) -> np.ndarray:
        """The values as float32 (a view for f32 tensors, a converted copy otherwise)."""
        if self._dtype is DType.F32:
            return self.data
        return self.data.astype(np.float32)

    def weight_f32(self) -> np.ndarray:
        """float32 copy kept with the tensor: weights are read every step, converted once."""
        if self._dtype is DType.F32:
            return self.data
        if self._f32_cache is None:
            self._f32_cache = self.data.astype(np.float32)
        return self._f32_cache

    def __repr__(self) -> str:
        return f"MockTensor({self.shape}, {self._dtype.value})"
