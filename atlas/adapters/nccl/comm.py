"""NcclComm: the CommBackend of CUDA ranks, one process per GPU, over NCCL (nccl4py).

Bootstrap: the driver calls `nccl_unique_id()` once and hands the bytes to every rank (the
launcher's StartRank); each rank builds its device, then
`NcclComm.connect(rank, world_size, unique_id, stream_handle)` on it, which returns once every
rank has joined (ncclCommInitRank). Collectives go straight to NCCL's C calls with the device
addresses of `CudaTensor`s, enqueued on the device backend's stream, so they are ordered with
its kernels and captured into its CUDA graphs like them (NCCL supports stream capture).

nccl4py comes with the `cuda` extra; it is imported only when a communicator is made, so
this module imports without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.comm import (
    CommError,
    check_all_gather,
    check_all_reduce,
    check_all_to_all,
    check_reduce_scatter,
)
from atlas.ports.gpu import DType, Tensor

# ncclDataType_t and ncclRedOp_t values (nccl.h; part of NCCL's ABI). Data that is only
# moved (gathers, all-to-all) goes as bytes.
_NCCL_UINT8 = 1
_NCCL_TYPES = {DType.I32: 2, DType.I64: 4, DType.F16: 6, DType.F32: 7, DType.BF16: 9}
_NCCL_SUM = 0


def _nccl_modules() -> tuple[Any, Any]:
    try:
        from nccl import core
        from nccl.bindings import nccl as bindings
    except ImportError as error:
        raise RuntimeError(f"NCCL needs the cuda extra (nccl4py): pip install 'atlas[cuda]' ({error})") from None
    return core, bindings


def nccl_unique_id() -> bytes:
    """A new NCCL unique id (ncclGetUniqueId) for one group of ranks. The process that makes it
    hosts NCCL's bootstrap root, so it must live until every rank has connected."""
    core, _ = _nccl_modules()
    return bytes(core.get_unique_id())


class NcclComm:
    """Collectives over CudaTensors on one stream; see `atlas.ports.comm` for the contract.

    A failed peer surfaces as an NCCL error of the next call or of `check_health` (NCCL's
    asynchronous error), or as a collective that never completes: a rank waiting on a dead
    peer's kernel cannot notice by itself, which is why the launcher watches the processes and
    kills the group. After an error every call raises CommError; `abort` then releases NCCL.
    """

    def __init__(self, rank: int, world_size: int, communicator: Any, bindings: Any, stream_handle: int,
                 barrier_address: int, free_barrier: Callable[[], None]) -> None:
        self._rank = rank
        self._world_size = world_size
        self._communicator = communicator  # nccl.core.Communicator (or a test's fake)
        self._bindings = bindings
        self._handle = bindings.Comm(communicator.ptr)  # a non-owning handle for the C calls
        self._stream = stream_handle
        self._barrier_address = barrier_address  # one i32 on the device, summed by `barrier`
        self._free_barrier = free_barrier
        self._released = False
        self._failure: CommError | None = None

    @classmethod
    def connect(cls, rank: int, world_size: int, unique_id: bytes, stream_handle: int) -> NcclComm:
        """Join the group of `unique_id` on the current device (the rank's backend made it
        current), ordering every collective on `stream_handle`. Blocks until all ranks join.
        NVLink multicast (NVLS) stays off: these hosts do not lend multicast objects."""
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # read by NCCL when the communicator is made
        core, bindings = _nccl_modules()
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        try:
            communicator = core.Communicator.init(world_size, rank, core.UniqueId.from_bytes(unique_id))
        except Exception as error:
            raise CommError(f"rank {rank}: NCCL could not form the group of {world_size}: {error}") from error
        address = int(check("cuMemAlloc", cu.cuMemAlloc(4)))
        check("cuMemsetD32Async", cu.cuMemsetD32Async(address, 0, 1, stream_handle))
        return cls(rank, world_size, communicator, bindings, stream_handle, address, lambda: cu.cuMemFree(address))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor) -> None:
        check_all_reduce(tensor)
        address = _address(tensor)
        count = math.prod(tensor.shape)
        self._call("all_reduce", self._bindings.all_reduce, address, address, count,
                   _NCCL_TYPES[tensor.dtype], _NCCL_SUM, self._handle, self._stream)

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        check_all_gather(src, out, self._world_size)
        self._call("all_gather", self._bindings.all_gather, _address(src), _address(out), _bytes(src),
                   _NCCL_UINT8, self._handle, self._stream)

    def reduce_scatter(self, src: Tensor, out: Tensor) -> None:
        check_reduce_scatter(src, out, self._world_size)
        self._call("reduce_scatter", self._bindings.reduce_scatter, _address(src), _address(out),
                   math.prod(out.shape), _NCCL_TYPES[out.dtype], _NCCL_SUM, self._handle, self._stream)

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        check_all_to_all(src, out, self._world_size)
        chunk_bytes = _bytes(src) // self._world_size
        self._call("all_to_all", self._bindings.allto_all, _address(src), _address(out), chunk_bytes,
                   _NCCL_UINT8, self._handle, self._stream)

    def barrier(self) -> None:
        """An all-reduce of one i32 on the stream: no rank's stream passes it before all arrive."""
        self._call("barrier", self._bindings.all_reduce, self._barrier_address, self._barrier_address, 1,
                   _NCCL_TYPES[DType.I32], _NCCL_SUM, self._handle, self._stream)

    # -- health and teardown -----------------------------------------------------------------
    def check_health(self) -> None:
        """Raise CommError if NCCL reports an asynchronous error (a peer or network failure)."""
        if self._failure is not None:
            raise self._failure
        result = self._communicator.get_async_error()
        if int(result) not in (0, 7):  # ncclSuccess, ncclInProgress
            self._failure = CommError(f"rank {self._rank}: NCCL reports {result!r}: "
                                      f"{self._communicator.get_last_error()}")
            raise self._failure

    def close(self) -> None:
        """Destroy the communicator (every rank calls it), or abort it after a failure; once."""
        if self._released:
            return
        if self._failure is not None:
            self.abort()
            return
        self._failure = CommError(f"rank {self._rank}: the communicator is closed")
        self._communicator.destroy()
        self._release()

    def abort(self) -> None:
        """Tear NCCL down without waiting for peers (after a failure; in-flight work is lost)."""
        if self._released:
            return
        if self._failure is None:
            self._failure = CommError(f"rank {self._rank}: the communicator was aborted")
        self._communicator.abort()
        self._release()

    def _release(self) -> None:
        self._released = True
        self._free_barrier()

    def _call(self, op: str, function: Any, *args: Any) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            function(*args)
        except Exception as error:  # nccl.bindings.nccl.NCCLError and friends
            self._failure = CommError(f"rank {self._rank}: NCCL {op} failed: {error}")
            raise self._failure from error


def cuda_copy(stream_handle: int) -> Callable[[Tensor, Tensor], None]:
    """LocalComm's copy for CudaTensors: a device-to-device copy on `stream_handle` (what the
    device protocol's own copy will do once it has one)."""
    from cuda.bindings import driver as cu

    from atlas.adapters.cuda.driver import check

    def copy(src: Tensor, dst: Tensor) -> None:
        if _bytes(src) != _bytes(dst):
            raise ValueError(f"copy: {_bytes(src)} bytes into {_bytes(dst)}")
        check("cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync(_address(dst), _address(src), _bytes(src), stream_handle))

    return copy


def _address(tensor: Tensor) -> int:
    if not isinstance(tensor, CudaTensor):
        raise TypeError(f"NcclComm works on CUDA tensors; got {type(tensor).__name__}")
    return tensor.address


def _bytes(tensor: Tensor) -> int:
    return math.prod(tensor.shape) * tensor.dtype.itemsize
