"""Thin helpers over `cuda.bindings.driver`: result checking and the few calls cuda.core lacks."""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""

    def __init__(self, call: str, result: Any) -> None:
        self.result = result
        _, name = cu.cuGetErrorName(result)
        _, text = cu.cuGetErrorString(result)
        decoded_name = name.decode() if isinstance(name, bytes) else str(name)
        decoded_text = text.decode() if isinstance(text, bytes) else str(text)
        super().__init__(f"{call} failed: {decoded_name} ({decoded_text})")

    @property
    def is_out_of_memory(self) -> bool:
        return self.result == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def check(call: str, returned: Any) -> Any:
    """Unpack a driver call's `(CUresult, *values)`; raise `CudaError` unless it succeeded."""
    if isinstance(returned, tuple):
        result, values = returned[0], returned[1:]
    else:
        result, values = returned, ()
    if result != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, result)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def address_of(handle: Any) -> int:
    """The integer value of a driver handle (CUdeviceptr, CUstream, ...)."""
    return int(handle)
