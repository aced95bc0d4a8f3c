"""Device tensors: an address, a shape and a dtype, sharing the allocation they came from."""

from __future__ import annotations

import math

from atlas.ports.gpu import DType, bitcast_last_dim


class CudaTensor:
    """A dense, row-major array in device memory.

    `owner` keeps the allocation alive: views and row slices hold the same owner, and the
    memory returns to the pool only when the last of them is gone.
    """

    __slots__ = ("address", "shape", "dtype", "owner")

    def __init__(self, address: int, shape: tuple[int, ...], dtype: DType, owner: object) -> None:
        self.address = address
        self.shape = shape
        self.dtype = dtype
        self.owner = owner

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def num_bytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    def view(self, *shape: int) -> CudaTensor:
        if math.prod(shape) != self.num_elements:
            raise ValueError(f"cannot view {self.shape} as {shape}")
        return CudaTensor(self.address, tuple(shape), self.dtype, self.owner)

    def rows(self, start: int, stop: int) -> CudaTensor:
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) out of range for {self.shape}")
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        return CudaTensor(self.address + start * row_bytes, (stop - start, *self.shape[1:]), self.dtype, self.owner)

    def bitcast(self, dtype: DType) -> CudaTensor:
        last = bitcast_last_dim(self.shape, self.dtype, dtype)
        if dtype.itemsize > self.dtype.itemsize and self.address % dtype.itemsize:
            raise ValueError(f"cannot bitcast to {dtype.value}: address 0x{self.address:x} is not aligned")
        return CudaTensor(self.address, (*self.shape[:-1], last), dtype, self.owner)

    def __repr__(self) -> str:
        return f"CudaTensor({self.shape}, {self.dtype.value}, 0x{self.address:x})"
