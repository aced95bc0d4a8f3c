"""All-reduce on N GPUs: our peer-to-peer kernels checked and timed against NCCL.

One rank process per GPU (`RankGroup`), each running `AllReduceRank`; the driver sends a
`CheckRequest` or a `TimeRequest` as a step and gathers every rank's rows. Used by
`benchmarks/allreduce.py` (prints the tables) and `tests/gpu/test_allreduce.py` (asserts the
checks). Every input is made from a seed, so each rank computes every rank's input and the
references on its own:

    exact      the float64 sum
    reference  the port's reference sum (rank order, f32 accumulation, one rounding), which the
               P2P kernels must match bit for bit
"""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import numpy as np

from atlas.adapters.comm.reference import reference_sum
from atlas.app.ranks import RankContext, RankGroup
from atlas.ports.gpu import NUMPY_DTYPES, DType

KIB = 1 << 10
MIB = 1 << 20
# 1 KB .. 64 MB, with sizes whose 16-byte units do not split evenly over the ranks (48 B, 1 KB
# + 16 B) and one that is no whole number of units (1000 B: NCCL's).
CHECK_SIZES = (48, 1 * KIB, 1 * KIB + 16, 1000, 8 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 8 * MIB, 16 * MIB,
               64 * MIB)
# The 8B's decode all-reduces: hidden 4096 x batch 1..32 x bf16.
DECODE_SIZES = (8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB, 256 * KIB)
PATHS = ("ll", "one_shot", "two_shot", "nccl")
# max |result - exact| / max |exact| allowed: ours and the reference round once from an f32
# sum; NCCL may round bf16 at each of its hops.
TOLERANCE = {("bf16", "ours"): 2.0**-7, ("bf16", "nccl"): 2.0**-5, ("f32", "ours"): 1e-5, ("f32", "nccl"): 1e-5}


class CheckRequest(msgspec.Struct, tag=True):
    sizes: list[int]
    dtypes: list[str]
    replays: int = 3


class TimeRequest(msgspec.Struct, tag=True):
    sizes: list[int]
    calls_per_graph: int = 32
    replays: int = 20


class CheckRow(msgspec.Struct):
    rank: int
    num_bytes: int
    dtype: str
    path: str  # ll | one_shot | two_shot | nccl | auto (what FastAllReduceComm chose) | graph
    relative_error: float
    bitwise: bool | None  # equals the reference sum bit for bit (None: not required of NCCL)
    ok: bool


class TimeRow(msgspec.Struct):
    rank: int
    num_bytes: int
    path: str
    us_per_call: float


Request = CheckRequest | TimeRequest


def rank_input(rank: int, count: int, dtype: DType, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count])
    return rng.standard_normal(count, dtype=np.float32).astype(NUMPY_DTYPES[dtype])


class Expected:
    """The float64 sum and the reference sum of every rank's input, and how a result compares."""

    def __init__(self, inputs: list[np.ndarray]) -> None:
        self.exact = sum(array.astype(np.float64) for array in inputs)
        self.reference = reference_sum(inputs).tobytes()
        self.scale = max(float(np.max(np.abs(self.exact))), 1e-30) if self.exact.size else 1.0

    def compare(self, result: np.ndarray, dtype: str, ours: bool) -> tuple[float, bool | None, bool]:
        """(relative error against the float64 sum, bit-equal to the reference sum, passes):
        ours must be bit-equal, NCCL within its tolerance."""
        error = float(np.max(np.abs(result.astype(np.float64) - self.exact))) / self.scale if result.size else 0.0
        bitwise = result.tobytes() == self.reference
        ok = error <= TOLERANCE[(dtype, "ours" if ours else "nccl")] and (bitwise or not ours)
        return error, (bitwise if ours else None), ok


class AllReduceRank:
    """A rank's worker: its runtime (device, stream, kernels) and FastAllReduceComm."""

    def __init__(self, context: RankContext, kernel_cache_dir: str | None = None) -> None:
        from atlas.adapters.cuda.custom_allreduce import FastAllReduceComm
        from atlas.adapters.cuda.runtime import CudaRuntime

        self.rank = context.rank
        self.world_size = context.world_size
        self.runtime = CudaRuntime(context.device_ordinal, Path(kernel_cache_dir) if kernel_cache_dir else None,
                                   None, "bf16")
        self.comm = FastAllReduceComm.connect(self.runtime, context.rank, context.world_size, context.comm_id)
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._encode = msgspec.msgpack.Encoder().encode

    def loaded(self) -> bytes:
        """The `RankWorker` ready message: nothing to report (no model is loaded)."""
        return b""

    def step(self, body: bytes) -> bytes:
        request = self._decoder.decode(body)
        if isinstance(request, CheckRequest):
            return self._encode(self._check(request))
        return self._encode(self._time(request))

    def close(self) -> None:
        self.comm.close()
        self.runtime.close()

    # -- checks ------------------------------------------------------------------------------
    def _check(self, request: CheckRequest) -> list[CheckRow]:
        rows = []
        for name in request.dtypes:
            dtype = DType(name)
            for num_bytes in request.sizes:
                if num_bytes % dtype.itemsize:
                    continue
                rows.extend(self._check_size(num_bytes, dtype))
            rows.extend(self._check_graph(dtype, request.replays))
        return rows

    def _check_size(self, num_bytes: int, dtype: DType) -> list[CheckRow]:
        count = num_bytes // dtype.itemsize
        inputs = [rank_input(rank, count, dtype, seed=1) for rank in range(self.world_size)]
        expected = Expected(inputs)
        tensor = self._empty(count, dtype)
        runs: list[tuple[str, object]] = []
        fast = self.comm.fast
        if fast is not None:
            runs += [(path, functools.partial(fast.launch, tensor, path)) for path in fast.paths(tensor)]
        runs.append(("nccl", functools.partial(self.comm.nccl.all_reduce, tensor)))
        runs.append(("auto", functools.partial(self.comm.all_reduce, tensor)))
        rows = []
        for path, run in runs:
            self._upload(tensor, inputs[self.rank])
            run()
            result = self._download(tensor)
            ours = path != "nccl" and (path != "auto" or (fast is not None and fast.takes(tensor)))
            error, bitwise, ok = expected.compare(result, dtype.value, ours)
            rows.append(CheckRow(self.rank, num_bytes, dtype.value, path, error, bitwise, ok))
        return rows

    def _check_graph(self, dtype: DType, replays: int) -> list[CheckRow]:
        """Two all-reduces per "layer" captured once and replayed on fresh inputs each time:
        one small (one-shot), one of 1 MiB (two-shot on 2 ranks, per the default sizes)."""
        counts = (8 * KIB // dtype.itemsize, MIB // dtype.itemsize)
        tensors = [self._empty(count, dtype) for count in counts]
        graph = self._capture(lambda: [self.comm.all_reduce(tensor) for tensor in tensors])
        rows = []
        for replay in range(replays):
            inputs = [[rank_input(rank, count, dtype, seed=100 + replay) for rank in range(self.world_size)]
                      for count in counts]
            for tensor, per_rank in zip(tensors, inputs):
                self._upload(tensor, per_rank[self.rank])
            graph.replay()
            for tensor, per_rank in zip(tensors, inputs):
                ours = self.comm.fast is not None and self.comm.fast.takes(tensor)
                error, bitwise, ok = Expected(per_rank).compare(self._download(tensor), dtype.value, ours)
                rows.append(CheckRow(self.rank, tensor.num_bytes, dtype.value, f"graph {replay}", error, bitwise, ok))
        return rows

    # -- timings -----------------------------------------------------------------------------
    def _time(self, request: TimeRequest) -> list[TimeRow]:
        rows = []
        for num_bytes in request.sizes:
            tensor = self._empty(num_bytes // 2, DType.BF16)
            self._upload(tensor, np.zeros(num_bytes // 2, NUMPY_DTYPES[DType.BF16]))  # sums stay finite
            for path in PATHS:
                if path != "nccl" and (self.comm.fast is None or path not in self.comm.fast.paths(tensor)):
                    continue
                if path == "nccl":
                    call = functools.partial(self.comm.nccl.all_reduce, tensor)
                else:
                    call = functools.partial(self.comm.fast.launch, tensor, path)
                graph = self._capture(lambda: [call() for _ in range(request.calls_per_graph)])
                seconds = self._time_replays(graph, request.replays)
                rows.append(TimeRow(self.rank, num_bytes, path, seconds / request.calls_per_graph * 1e6))
        return rows

    def _time_replays(self, graph: _Graph, replays: int) -> float:
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        stream = self.runtime.stream_handle
        for _ in range(3):
            graph.replay()
        self.comm.barrier()  # the ranks start the timed replays together
        self.runtime.synchronize()
        start, stop = (check("cuEventCreate", cu.cuEventCreate(0)) for _ in range(2))
        check("cuEventRecord", cu.cuEventRecord(start, stream))
        for _ in range(replays):
            graph.replay()
        check("cuEventRecord", cu.cuEventRecord(stop, stream))
        check("cuEventSynchronize", cu.cuEventSynchronize(stop))
        elapsed_ms = check("cuEventElapsedTime", cu.cuEventElapsedTime(start, stop))
        for event in (start, stop):
            cu.cuEventDestroy(event)
        return float(elapsed_ms) * 1e-3 / replays

    # -- device helpers ----------------------------------------------------------------------
    def _empty(self, count: int, dtype: DType):
        from atlas.adapters.cuda.tensor import CudaTensor

        allocation = self.runtime.pool.allocate(count * dtype.itemsize)
        return CudaTensor(allocation.address, (count,), dtype, allocation)

    def _upload(self, tensor, array: np.ndarray) -> None:
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        data = np.ascontiguousarray(array)
        check("cuMemcpyHtoDAsync",
              cu.cuMemcpyHtoDAsync(tensor.address, data.ctypes.data, data.nbytes, self.runtime.stream_handle))
        self.runtime.synchronize()

    def _download(self, tensor) -> np.ndarray:
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        out = np.empty(tensor.shape, NUMPY_DTYPES[tensor.dtype])
        check("cuMemcpyDtoHAsync",
              cu.cuMemcpyDtoHAsync(out.ctypes.data, tensor.address, out.nbytes, self.runtime.stream_handle))
        self.runtime.synchronize()
        return out

    def _capture(self, fn) -> _Graph:
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        stream = self.runtime.stream_handle
        self.runtime.synchronize()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        check("cuStreamBeginCapture", cu.cuStreamBeginCapture(stream, mode))
        try:
            fn()
        finally:
            graph = check("cuStreamEndCapture", cu.cuStreamEndCapture(stream))
        return _Graph(graph, check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0)), stream)


class _Graph:
    def __init__(self, graph: object, executable: object, stream: int) -> None:
        self._graph, self._executable, self._stream = graph, executable, stream

    def replay(self) -> None:
        from cuda.bindings import driver as cu

        from atlas.adapters.cuda.driver import check

        check("cuGraphLaunch", cu.cuGraphLaunch(self._executable, self._stream))

    def __del__(self) -> None:
        from cuda.bindings import driver as cu

        cu.cuGraphExecDestroy(self._executable)
        cu.cuGraphDestroy(self._graph)


def all_reduce_rank(context: RankContext, kernel_cache_dir: str | None = None) -> AllReduceRank:
    return AllReduceRank(context, kernel_cache_dir)


# -- the driver's side ---------------------------------------------------------------------------


def start_group(world_size: int, kernel_cache_dir: str | None = None, step_timeout_s: float | None = 600.0) -> RankGroup:
    """One AllReduceRank per GPU 0..world_size-1, started (NCCL's id made here)."""
    from atlas.adapters.nccl.comm import nccl_unique_id

    group = RankGroup(world_size, functools.partial(all_reduce_rank, kernel_cache_dir=kernel_cache_dir),
                      nccl_unique_id(), step_timeout_s=step_timeout_s)
    group.start()
    return group


def run_checks(group: RankGroup, sizes=CHECK_SIZES, dtypes=("bf16", "f32")) -> list[CheckRow]:
    replies = group.step(msgspec.msgpack.encode(CheckRequest(list(sizes), list(dtypes))))
    return [row for reply in replies for row in msgspec.msgpack.decode(reply, type=list[CheckRow])]


def run_timings(group: RankGroup, sizes=DECODE_SIZES) -> list[TimeRow]:
    replies = group.step(msgspec.msgpack.encode(TimeRequest(list(sizes))))
    return [row for reply in replies for row in msgspec.msgpack.decode(reply, type=list[TimeRow])]
