"""NcclComm without a GPU: the C calls it makes (addresses, counts, NCCL types, stream) through a
recording fake of nccl4py's bindings, its argument checks and its failure state."""

from __future__ import annotations

import importlib.util

import pytest

from atlas.adapters.cuda.tensor import CudaTensor
from atlas.adapters.mock.tensor import MockTensor
from atlas.adapters.nccl.comm import NcclComm, nccl_unique_id
from atlas.ports.comm import CommError
from atlas.ports.gpu import DType

STREAM = 0x5000
BARRIER = 0x6000


class FakeBindings:
    """nccl.bindings.nccl's calls, recorded; `fail` makes the next call raise."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = False

    class Comm:
        def __init__(self, pointer: int) -> None:
            self.pointer = pointer

    def _record(self, name, *args):
        if self.fail:
            raise RuntimeError("NCCL failure: remote process exited or there was a network error")
        self.calls.append((name, *[arg.pointer if isinstance(arg, FakeBindings.Comm) else arg for arg in args]))

    def all_reduce(self, *args):
        self._record("all_reduce", *args)

    def all_gather(self, *args):
        self._record("all_gather", *args)

    def reduce_scatter(self, *args):
        self._record("reduce_scatter", *args)

    def allto_all(self, *args):
        self._record("allto_all", *args)


class FakeCommunicator:
    ptr = 0xC0
    destroyed = aborted = False
    async_error = 0
    barrier_frees = 0

    def free_barrier(self):
        self.barrier_frees += 1

    def destroy(self):
        self.destroyed = True

    def abort(self):
        self.aborted = True

    def get_async_error(self):
        return self.async_error

    def get_last_error(self):
        return "peer 3 unreachable"


def make(world_size: int = 4, rank: int = 1):
    bindings, communicator = FakeBindings(), FakeCommunicator()
    comm = NcclComm(rank, world_size, communicator, bindings, STREAM, BARRIER, communicator.free_barrier)
    return comm, bindings, communicator


def cuda(address: int, shape: tuple[int, ...], dtype: DType) -> CudaTensor:
    return CudaTensor(address, shape, dtype, owner=None)


def test_each_collective_is_one_nccl_call_on_the_stream_with_the_right_counts_and_types():
    comm, bindings, _ = make(world_size=4)
    comm.all_reduce(cuda(0x1000, (4, 8), DType.BF16))
    comm.all_reduce(cuda(0x1100, (3,), DType.F32))
    comm.all_gather(cuda(0x2000, (2, 8), DType.BF16), cuda(0x3000, (8, 8), DType.BF16))
    comm.reduce_scatter(cuda(0x4000, (8, 4), DType.I32), cuda(0x4800, (2, 4), DType.I32))
    comm.all_to_all(cuda(0x7000, (8, 6), DType.FP8_E4M3), cuda(0x8000, (8, 6), DType.FP8_E4M3))
    comm.barrier()
    assert bindings.calls == [
        ("all_reduce", 0x1000, 0x1000, 32, 9, 0, 0xC0, STREAM),  # in place, ncclBfloat16, ncclSum
        ("all_reduce", 0x1100, 0x1100, 3, 7, 0, 0xC0, STREAM),  # ncclFloat32
        ("all_gather", 0x2000, 0x3000, 32, 1, 0xC0, STREAM),  # 16 bf16 per rank sent as 32 bytes
        ("reduce_scatter", 0x4000, 0x4800, 8, 2, 0, 0xC0, STREAM),  # 8 i32 received per rank
        ("allto_all", 0x7000, 0x8000, 12, 1, 0xC0, STREAM),  # 2 rows x 6 fp8 bytes per peer
        ("all_reduce", BARRIER, BARRIER, 1, 2, 0, 0xC0, STREAM),  # one i32
    ]


def test_bad_arguments_are_refused_before_nccl_hears_of_them():
    comm, bindings, _ = make(world_size=2)
    with pytest.raises(ValueError, match="all_gather: out must be"):
        comm.all_gather(cuda(0x2000, (2, 8), DType.BF16), cuda(0x3000, (2, 8), DType.BF16))
    with pytest.raises(ValueError, match="all_reduce: tensor is u8"):
        comm.all_reduce(cuda(0x1000, (4,), DType.U8))
    with pytest.raises(TypeError, match="NcclComm works on CUDA tensors; got MockTensor"):
        comm.all_reduce(_mock())
    assert bindings.calls == []


def _mock() -> MockTensor:
    import numpy as np

    return MockTensor(np.zeros(4, np.float32), DType.F32)


def test_an_nccl_error_fails_the_communicator_for_good_and_close_aborts_it():
    comm, bindings, communicator = make()
    bindings.fail = True
    with pytest.raises(CommError, match="rank 1: NCCL all_reduce failed: NCCL failure: remote process exited"):
        comm.all_reduce(cuda(0x1000, (4,), DType.F32))
    bindings.fail = False
    with pytest.raises(CommError, match="NCCL all_reduce failed"):
        comm.barrier()
    comm.close()
    assert communicator.aborted and not communicator.destroyed and communicator.barrier_frees == 1


def test_an_asynchronous_error_is_reported_by_check_health():
    comm, _, communicator = make()
    comm.check_health()
    communicator.async_error = 7  # ncclInProgress: fine
    comm.check_health()
    communicator.async_error = 6  # ncclRemoteError
    with pytest.raises(CommError, match="rank 1: NCCL reports 6: peer 3 unreachable"):
        comm.check_health()
    with pytest.raises(CommError):
        comm.barrier()


def test_close_destroys_and_later_calls_refuse():
    comm, _, communicator = make()
    comm.close()
    comm.close()
    assert communicator.destroyed and not communicator.aborted and communicator.barrier_frees == 1
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(cuda(0x1000, (4,), DType.F32))


@pytest.mark.skipif(importlib.util.find_spec("nccl") is not None, reason="nccl4py is installed")
def test_without_the_cuda_extra_making_an_id_says_what_to_install():
    with pytest.raises(RuntimeError, match=r"NCCL needs the cuda extra \(nccl4py\)"):
        nccl_unique_id()
