"""Argument checks shared by the ops: each failure is a `ValueError` naming the argument."""

from __future__ import annotations

from collections.abc import Iterable

from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType, Tensor


def tensor(value: object, name: str) -> CudaTensor:
    if not isinstance(value, CudaTensor):
        raise ValueError(f"{name}: expected a CudaTensor, got {type(value).__name__}")
    return value


def address(value: Tensor, name: str) -> int:
    """The device address of a port tensor, which must be this backend's."""
    return tensor(value, name).address


def dtype(value: Tensor, name: str, allowed: Iterable[DType]) -> None:
    allowed = tuple(allowed)
    if value.dtype not in allowed:
        names = ", ".join(d.value for d in allowed)
        raise ValueError(f"{name}: dtype {value.dtype.value} is not supported here (expected {names})")


def shape(value: Tensor, name: str, expected: tuple[int, ...]) -> None:
    if value.shape != expected:
        raise ValueError(f"{name}: shape {list(value.shape)} does not match the expected {list(expected)}")


def rank(value: Tensor, name: str, num_dims: int) -> None:
    if len(value.shape) != num_dims:
        raise ValueError(f"{name}: expected {num_dims} dimensions, got shape {list(value.shape)}")


def at_least_rows(value: Tensor, name: str, num_rows: int) -> None:
    if not value.shape or value.shape[0] < num_rows:
        raise ValueError(f"{name}: needs at least {num_rows} rows, has shape {list(value.shape)}")


def aligned(address: int, num_bytes: int) -> bool:
    return address % num_bytes == 0


def type_suffix(value: DType) -> str:
    """The kernel-name suffix of an element type: `bf16` or `f32`."""
    return {DType.BF16: "bf16", DType.F32: "f32"}[value]
