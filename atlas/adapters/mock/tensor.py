"""Host-memory tensors for the mock backend: numpy arrays with the port's dtype names."""

from __future__ import annotations

import numpy as np

from atlas.ports.gpu import NUMPY_DTYPES, DType, bitcast_last_dim


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

    def bitcast(self, dtype: DType) -> MockTensor:
        bitcast_last_dim(self.shape, self._dtype, dtype)  # checks the sizes
        return MockTensor(self.data.view(NUMPY_DTYPES[dtype]), dtype)

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
