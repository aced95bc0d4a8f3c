"""The fast small all-reduce: our peer-to-peer kernels below a size, NCCL above it.

Batch-1 decode makes two all-reduces of a few KB per layer; NCCL spends ~10-20 us on each in
protocol and launch. `kernels/common/allreduce.cu` does them in one kernel over NVLink: for the
smallest, each rank pushes its data, a flag beside every 4 bytes, into its peers' memory ("LL",
no barrier); then one-shot (read every peer's buffer after a barrier), then reduce-scatter +
all-gather ("two-shot") for mid sizes. The barriers' flags live in peer-mapped memory and the
kernel itself advances them, so a captured graph replays them with no host work.

Setup, once per rank and collective over the group:

    1. allocate one region, [signals | slot 0 | slot 1] (see the kernel header), zeroed
    2. export it as a CUDA IPC handle (cuIpcGetMemHandle, 64 bytes)
    3. all-gather every rank's handle and device ordinal through NCCL
    4. open every peer's region (cuIpcOpenMemHandle) and upload the table of the N regions'
       addresses as mapped here, which each launch passes to the kernel

No multicast objects are made (NVLS stays off). Legacy IPC opens only handles of devices the
process can see, so every rank keeps all the host's GPUs visible and picks its own by ordinal
(the launcher does). Every rank must agree to use the kernels: if any rank lacks peer access
to any other, all of them keep NCCL for everything.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.adapters.nccl.comm import NcclComm
from atlas.ports.comm import check_all_reduce
from atlas.ports.gpu import DType, Tensor

MODULE = "allreduce"
SIGNAL_BYTES = 16384  # ALLREDUCE_SIGNAL_BYTES
THREADS = 512  # ALLREDUCE_THREADS
MAX_BLOCKS = 64  # ALLREDUCE_MAX_BLOCKS
# Threads a block of the LL kernels: 2 NVIDIA H200s, us per all-reduce of 8 / 64 / 256 KB with
# blocks of 512 threads (up to 32) 3.92 / 3.41 / 5.62, of 128 (up to 64) 2.65 / 3.29 / 5.59, of 64
# 2.57 / 2.82 / 4.08, of 32 6.18 / 3.08 / 6.69 (one-shot 5.28 / 4.49 / 4.87).
LL_THREADS = 64
# The largest message the LL kernels take: each rank's region holds two slots of lines for it
# from every rank, at twice the message's bytes (world_size x 2 x 2 x this, 1-4 MB).
LL_CAPACITY_BYTES = 256 << 10
WORLD_SIZES = (2, 4, 8)
_UNIT_BYTES = 16
_IPC_HANDLE_BYTES = 64
_DTYPE_NAMES = {DType.BF16: "bf16", DType.F32: "f32"}

Exchange = Callable[[bytes], list[bytes]]  # every rank's bytes (same length), in rank order


@dataclass(frozen=True, slots=True)
class AllReduceSizes:
    """Which path takes an all-reduce of `num_bytes`: LL up to `ll_max_bytes` (at most
    LL_CAPACITY_BYTES; 0: never), one-shot up to `one_shot_max_bytes`, two-shot up to
    `two_shot_max_bytes` (at most the slot size), NCCL above. LL crosses NVLink once but sends
    twice the bytes; one-shot reads (N-1) messages over NVLink after a barrier, two-shot 2 (N-1)/N
    of one plus a second barrier, so each one's reach shrinks as N grows; `benchmarks/allreduce.py`
    measures where each crossover lies."""

    one_shot_max_bytes: int
    two_shot_max_bytes: int
    max_blocks: int = 32
    ll_max_bytes: int = 0

    @classmethod
    def default(cls, world_size: int, ll: bool = True) -> AllReduceSizes:
        """`ll`: whether the LL kernels take the smallest messages (`ATLAS_CUDA_DISABLE=allreduce_ll`
        turns them off)."""
        one_shot = {2: 512 << 10, 4: 256 << 10, 8: 128 << 10}[world_size]
        # 2 H200s: LL takes the 8B's batch-1 all-reduces (8 KB; TP=2 step 2.608 -> 2.425 ms), but
        # inside Qwen3-30B-A3B's expert-parallel batch-64 step its 256 KB all-reduces cost more than
        # one-shot (11.869 against 11.542 ms), though faster alone (4.09 against 4.92 us): its 64
        # blocks polling beside the next kernel. On 4 and 8 GPUs the LL kernels have not run yet.
        ll_max = {2: 32 << 10, 4: 0, 8: 0}[world_size] if ll else 0
        return cls(one_shot_max_bytes=one_shot, two_shot_max_bytes=8 << 20, ll_max_bytes=ll_max)

    def path(self, num_bytes: int) -> str | None:
        """"ll", "one_shot", "two_shot", or None for NCCL."""
        if num_bytes <= self.ll_max_bytes:
            return "ll"
        if num_bytes <= self.one_shot_max_bytes:
            return "one_shot"
        if num_bytes <= self.two_shot_max_bytes:
            return "two_shot"
        return None


class P2PAllReduce:
    """All-reduce of bf16/f32 CudaTensors through the peer-to-peer kernels, in place.

    `exchange` all-gathers host bytes across the ranks (`nccl_exchange`); `timeout_s` is how
    long a kernel waits for a peer before it traps (a dead peer then fails this rank instead
    of hanging it). `close` is collective too.
    """

    def __init__(
        self,
        runtime: CudaRuntime,
        rank: int,
        world_size: int,
        exchange: Exchange,
        sizes: AllReduceSizes | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if world_size not in WORLD_SIZES:
            raise ValueError(f"the P2P all-reduce runs on {WORLD_SIZES} ranks, not {world_size}")
        self._runtime = runtime
        self._rank = rank
        self._world_size = world_size
        self._exchange = exchange
        self.sizes = sizes or AllReduceSizes.default(world_size, ll=runtime.features.allreduce_ll)
        if not 0 < self.sizes.max_blocks <= MAX_BLOCKS:
            raise ValueError(f"max_blocks must be in 1..{MAX_BLOCKS} (got {self.sizes.max_blocks})")
        if self.sizes.ll_max_bytes > LL_CAPACITY_BYTES:
            raise ValueError(f"ll_max_bytes must be at most {LL_CAPACITY_BYTES} (got {self.sizes.ll_max_bytes})")
        self._slot_bytes = _round_up(self.sizes.two_shot_max_bytes, _UNIT_BYTES)
        self._line_slot_bytes = world_size * 2 * LL_CAPACITY_BYTES
        self._region_bytes = SIGNAL_BYTES + 2 * self._slot_bytes + 2 * self._line_slot_bytes
        self._timeout_ns = np.int64(int(timeout_s * 1e9))
        runtime.ensure_current()
        self._region = int(check("cuMemAlloc", cu.cuMemAlloc(self._region_bytes)))
        self._peers: list[int] = []
        self._table = 0
        try:
            self._open_peers()
        except BaseException:
            self._release()
            raise

    def _open_peers(self) -> None:
        stream = self._runtime.stream_handle
        # the flags, and the LL lines (a line is either zero or its call's)
        check("cuMemsetD8Async", cu.cuMemsetD8Async(self._region, 0, SIGNAL_BYTES, stream))
        lines = self._region + SIGNAL_BYTES + 2 * self._slot_bytes
        check("cuMemsetD8Async", cu.cuMemsetD8Async(lines, 0, 2 * self._line_slot_bytes, stream))
        check("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
        handle = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(self._region))
        handles = self._exchange(ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES))
        regions = []
        for peer, data in enumerate(handles):
            if peer == self._rank:
                regions.append(self._region)
                continue
            peer_handle = cu.CUipcMemHandle()
            ctypes.memmove(peer_handle.getPtr(), data, _IPC_HANDLE_BYTES)
            flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            address = int(check("cuIpcOpenMemHandle", cu.cuIpcOpenMemHandle(peer_handle, flags)))
            self._peers.append(address)
            regions.append(address)
        table = np.array(regions, np.uint64)  # [world_size] region addresses as mapped here
        self._table = int(check("cuMemAlloc", cu.cuMemAlloc(table.nbytes)))
        check("cuMemcpyHtoD", cu.cuMemcpyHtoD(self._table, table.ctypes.data, table.nbytes))
        self._exchange(b"")  # every rank has mapped every region before any kernel signals into one

    def takes(self, tensor: Tensor) -> bool:
        """Whether `all_reduce` handles this tensor (else the caller uses NCCL): bf16 or f32,
        a whole number of 16-byte units, 16-byte aligned, no larger than two_shot_max_bytes."""
        if not isinstance(tensor, CudaTensor) or tensor.dtype not in _DTYPE_NAMES:
            return False
        num_bytes = tensor.num_bytes
        return (
            0 < num_bytes <= self.sizes.two_shot_max_bytes
            and num_bytes % _UNIT_BYTES == 0
            and tensor.address % _UNIT_BYTES == 0
        )

    def all_reduce(self, tensor: Tensor) -> None:
        """Sum `tensor` over the ranks in place, on the runtime's stream (capturable)."""
        check_all_reduce(tensor)
        if not self.takes(tensor):
            raise ValueError(f"the P2P all-reduce does not take {tensor!r}; use NCCL")
        self._launch(tensor, self.sizes.path(tensor.num_bytes) or "two_shot")

    def paths(self, tensor: Tensor) -> tuple[str, ...]:
        """The paths `launch` takes this tensor by (none unless `takes`)."""
        if not self.takes(tensor):
            return ()
        return ("ll", "one_shot", "two_shot") if tensor.num_bytes <= LL_CAPACITY_BYTES else ("one_shot", "two_shot")

    def launch(self, tensor: CudaTensor, path: str) -> None:
        """One kernel of `path` (one of `paths(tensor)`) over `tensor`, in place; the
        benchmark forces a path with it, `all_reduce` picks one."""
        if path not in self.paths(tensor):
            raise ValueError(f"the P2P all-reduce's {path!r} path does not take {tensor!r}")
        self._launch(tensor, path)

    def _launch(self, tensor: CudaTensor, path: str) -> None:
        units = tensor.num_bytes // _UNIT_BYTES
        spread = math.ceil(units / self._world_size) if path == "two_shot" else units
        if path == "ll":  # small blocks: more SMs push and poll
            threads, cap = LL_THREADS, MAX_BLOCKS
        else:
            threads, cap = THREADS, self.sizes.max_blocks
        blocks = max(1, min(math.ceil(spread / threads), cap))
        symbol = f"allreduce_{path}_{_DTYPE_NAMES[tensor.dtype]}_w{self._world_size}"
        slots = (np.int64(self._slot_bytes), np.int64(self._line_slot_bytes)) if path == "ll" else (
            np.int64(self._slot_bytes),)
        self._runtime.launch(
            MODULE, symbol, (blocks,), threads,
            tensor.address, tensor.address, self._table, np.int32(self._rank), np.int64(units), *slots,
            self._timeout_ns,
        )

    def close(self) -> None:
        """Unmap the peers' regions, wait until every rank has, and free ours (collective)."""
        self._runtime.synchronize()
        for address in self._peers:
            check("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(address))
        self._peers = []
        self._exchange(b"")  # no rank still maps our region
        self._release()

    def _release(self) -> None:
        for address in self._peers:
            cu.cuIpcCloseMemHandle(address)
        self._peers = []
        for address in (self._table, self._region):
            if address:
                cu.cuMemFree(address)
        self._table = self._region = 0


class FastAllReduceComm:
    """NCCL for every collective, but all-reduces the P2P kernels take go to them."""

    def __init__(self, nccl: NcclComm, fast: P2PAllReduce | None) -> None:
        self._nccl = nccl
        self._fast = fast

    @classmethod
    def connect(cls, runtime: CudaRuntime, rank: int, world_size: int, unique_id: bytes,
                sizes: AllReduceSizes | None = None) -> FastAllReduceComm:
        """NcclComm.connect on the runtime's stream, plus the P2P all-reduce where every rank
        can reach every other rank's memory (checked collectively, so all ranks agree)."""
        runtime.ensure_current()
        nccl = NcclComm.connect(rank, world_size, unique_id, runtime.stream_handle)
        exchange = nccl_exchange(nccl, runtime)
        ordinals = [int.from_bytes(data, "little") for data in
                    exchange(runtime.device.device_id.to_bytes(4, "little"))]
        reachable = world_size in WORLD_SIZES and all(
            _can_access_peer(ordinals[rank], ordinal) for peer, ordinal in enumerate(ordinals) if peer != rank
        )
        everyone = all(data == b"\x01" for data in exchange(b"\x01" if reachable else b"\x00"))
        fast = P2PAllReduce(runtime, rank, world_size, exchange, sizes) if everyone else None
        return cls(nccl, fast)

    @property
    def rank(self) -> int:
        return self._nccl.rank

    @property
    def world_size(self) -> int:
        return self._nccl.world_size

    @property
    def fast(self) -> P2PAllReduce | None:
        """The P2P all-reduce, or None where the ranks keep NCCL for everything."""
        return self._fast

    @property
    def nccl(self) -> NcclComm:
        return self._nccl

    def all_reduce(self, tensor: Tensor) -> None:
        if self._fast is not None and self._fast.takes(tensor):
            self._fast.all_reduce(tensor)
        else:
            self._nccl.all_reduce(tensor)

    def all_gather(self, src: Tensor, out: Tensor) -> None:
        self._nccl.all_gather(src, out)

    def reduce_scatter(self, src: Tensor, out: Tensor) -> None:
        self._nccl.reduce_scatter(src, out)

    def all_to_all(self, src: Tensor, out: Tensor) -> None:
        self._nccl.all_to_all(src, out)

    def barrier(self) -> None:
        self._nccl.barrier()

    def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
        self._nccl.close()


def nccl_exchange(nccl: NcclComm, runtime: CudaRuntime) -> Exchange:
    """All-gather of host bytes over NCCL (setup only: it synchronizes the stream). Every rank
    passes the same number of bytes."""

    def exchange(data: bytes) -> list[bytes]:
        size = max(len(data), 1)
        host = np.zeros(size, np.uint8)
        host[: len(data)] = np.frombuffer(data, np.uint8)
        gathered = np.empty(size * nccl.world_size, np.uint8)
        stream = runtime.stream_handle
        src = runtime.pool.allocate(size)
        out = runtime.pool.allocate(gathered.nbytes)
        check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(src.address, host.ctypes.data, size, stream))
        nccl.all_gather(CudaTensor(src.address, (size,), DType.U8, src),
                        CudaTensor(out.address, (gathered.size,), DType.U8, out))
        check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(gathered.ctypes.data, out.address, gathered.nbytes, stream))
        check("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
        return [gathered[rank * size: rank * size + len(data)].tobytes() for rank in range(nccl.world_size)]

    return exchange


def _can_access_peer(ordinal: int, peer_ordinal: int) -> bool:
    if ordinal == peer_ordinal:
        return False  # two ranks on one GPU: NCCL copes, the kernels' IPC does not
    own = check("cuDeviceGet", cu.cuDeviceGet(ordinal))
    peer = check("cuDeviceGet", cu.cuDeviceGet(peer_ordinal))
    return bool(check("cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(own, peer)))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
