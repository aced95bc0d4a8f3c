"""Device memory: a caching allocator with accounting, and pinned host staging for copies.

The pool rounds every request to a size class (512-byte steps below 1 MiB, 2 MiB steps above)
and keeps freed blocks on a free list per class, so the steady state of a server allocates
nothing from the driver. One stream orders every use of a block, so a block freed by Python
can be handed out again at once: later work on the stream runs after earlier reads of it.
When the driver is out of memory the pool returns its cached blocks and tries once more.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import CudaError, check
from atlas.adapters.cuda.upload_ring import RingStats, UploadRing

_SMALL_LIMIT_BYTES = 1 << 20
_SMALL_STEP_BYTES = 512
_LARGE_STEP_BYTES = 2 << 20


def size_class(num_bytes: int) -> int:
    """The rounded size a request of `num_bytes` occupies (at least one step)."""
    step = _SMALL_STEP_BYTES if num_bytes < _SMALL_LIMIT_BYTES else _LARGE_STEP_BYTES
    return max(step, -(-num_bytes // step) * step)


@dataclass(frozen=True, slots=True)
class PoolStats:
    allocated_bytes: int  # held by live tensors (rounded sizes)
    reserved_bytes: int  # obtained from the driver, live or cached
    peak_allocated_bytes: int
    num_driver_allocations: int
    num_reused: int

    @property
    def cached_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes


class DeviceAllocation:
    """One block of the pool; returns itself to the pool when garbage collected."""

    __slots__ = ("address", "num_bytes", "_pool")

    def __init__(self, address: int, num_bytes: int, pool: DeviceMemoryPool) -> None:
        self.address = address
        self.num_bytes = num_bytes
        self._pool: DeviceMemoryPool | None = pool

    def __del__(self) -> None:
        pool = self._pool
        if pool is not None:
            self._pool = None
            pool.release(self.address, self.num_bytes)


class DeviceMemoryPool:
    """Caching allocator over cuMemAlloc for one device context."""

    def __init__(self, device_label: str) -> None:
        self._device_label = device_label
        self._free: dict[int, list[int]] = {}
        self._allocated_bytes = 0
        self._reserved_bytes = 0
        self._peak_bytes = 0
        self._num_driver_allocations = 0
        self._num_reused = 0
        self._live: dict[int, int] = {}  # address -> rounded size of every block a tensor holds
        self._closed = False

    def allocate(self, num_bytes: int) -> DeviceAllocation:
        """A block of at least `num_bytes`. Raises `MemoryError` naming the sizes involved."""
        rounded = size_class(num_bytes)
        cached = self._free.get(rounded)
        if cached:
            address = cached.pop()
            self._num_reused += 1
        else:
            address = self._driver_allocate(rounded, num_bytes)
            self._reserved_bytes += rounded
            self._num_driver_allocations += 1
        self._allocated_bytes += rounded
        self._peak_bytes = max(self._peak_bytes, self._allocated_bytes)
        self._live[address] = rounded
        return DeviceAllocation(address, rounded, self)

    def release(self, address: int, rounded: int) -> None:
        """Back onto its free list (called by `DeviceAllocation.__del__`)."""
        if self._closed:
            return
        del self._live[address]
        self._allocated_bytes -= rounded
        self._free.setdefault(rounded, []).append(address)

    def empty_cache(self) -> int:
        """Give every cached block back to the driver; returns the bytes freed."""
        freed = 0
        for rounded, addresses in self._free.items():
            for address in addresses:
                check("cuMemFree", cu.cuMemFree(address))
                freed += rounded
        self._free.clear()
        self._reserved_bytes -= freed
        return freed

    def stats(self) -> PoolStats:
        return PoolStats(
            allocated_bytes=self._allocated_bytes,
            reserved_bytes=self._reserved_bytes,
            peak_allocated_bytes=self._peak_bytes,
            num_driver_allocations=self._num_driver_allocations,
            num_reused=self._num_reused,
        )

    def close(self) -> None:
        """Give every block back to the driver, the ones tensors still hold too, and stop
        accepting returns: an engine's weights, caches and buffers are freed even while objects
        that point at them live on (`atlas.LLM.close`; its tensors must not be used again)."""
        if self._closed:
            return
        self.empty_cache()
        for address in self._live:
            check("cuMemFree", cu.cuMemFree(address))
        self._reserved_bytes -= sum(self._live.values())
        self._allocated_bytes = 0
        self._live.clear()
        self._closed = True

    def _driver_allocate(self, rounded: int, asked: int) -> int:
        for attempt in range(2):
            try:
                return int(check("cuMemAlloc", cu.cuMemAlloc(rounded)))
            except CudaError as error:
                if not error.is_out_of_memory:
                    raise
                if attempt == 0 and self._free:
                    self.empty_cache()
                    continue
                free, total = check("cuMemGetInfo", cu.cuMemGetInfo())
                raise MemoryError(
                    f"CUDA {self._device_label}: cannot allocate {asked / 2**20:.1f} MiB; "
                    f"{free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB, Atlas tensors hold "
                    f"{self._allocated_bytes / 2**20:.1f} MiB (lower --max-num-seqs, --max-seq-len or "
                    f"--gpu-memory-utilization)"
                ) from error
        raise AssertionError("unreachable")


class BulkUploads:
    """Large host-to-device copies (the weights at load) through `UploadRing`: a ring of
    page-locked slots filled by `num_threads` threads, each slot's DMA enqueued on the stream in
    order, with an event after it that says when the slot may be written again. With
    `read_files`, a memory-mapped checkpoint's tensors are read from their files (preadv), and
    such an upload is only queued (`UploadRing`): `flush` before other work on the stream."""

    def __init__(
        self,
        stream_handle: int,
        num_slots: int = 32,
        slot_bytes: int = 8 << 20,
        num_threads: int = 12,
        read_files: bool = True,
    ) -> None:
        self.slot_bytes = slot_bytes
        self._stream = stream_handle
        self._base = int(check("cuMemHostAlloc", cu.cuMemHostAlloc(num_slots * slot_bytes, 0)))
        buffer = (ctypes.c_uint8 * (num_slots * slot_bytes)).from_address(self._base)
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events = [check("cuEventCreate", cu.cuEventCreate(flags)) for _ in range(num_slots)]
        self._ring = UploadRing(np.ctypeslib.as_array(buffer), slot_bytes, self, num_threads, read_files=read_files)

    def upload(self, device_address: int, pieces: Sequence[np.ndarray]) -> None:
        """Enqueue (or, read from files, queue) the copy of the contiguous `pieces`, laid end
        to end from `device_address` (`UploadRing.upload`)."""
        self._ring.upload(device_address, pieces)

    def queues(self, pieces: Sequence[np.ndarray]) -> bool:
        """Whether `upload` would only queue these pieces (`UploadRing.queues`)."""
        return self._ring.queues(pieces)

    @property
    def queued(self) -> Sized:
        """`UploadRing.queued`: truthy while uploads wait to be put on the stream."""
        return self._ring.queued

    @property
    def stats(self) -> RingStats:
        return self._ring.stats

    def flush(self) -> None:
        """Enqueue every queued chunk's DMA (`UploadRing.flush`; raises a failed read)."""
        self._ring.flush()

    def send(self, slot: int, num_bytes: int, device_address: int) -> None:
        """`SlotTransport.send`: the slot's DMA on the stream, then its event."""
        host = self._base + slot * self.slot_bytes
        check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(device_address, host, num_bytes, self._stream))
        check("cuEventRecord", cu.cuEventRecord(self._events[slot], self._stream))

    def wait(self, slot: int) -> None:
        """`SlotTransport.wait`."""
        check("cuEventSynchronize", cu.cuEventSynchronize(self._events[slot]))

    def close(self) -> None:
        try:
            self._ring.close()
        finally:
            for event in self._events:
                cu.cuEventDestroy(event)
            cu.cuMemFreeHost(self._base)


class PinnedStaging:
    """Page-locked host slots for small copies that stay asynchronous.

    A copy of up to `slot_bytes` goes through the next slot in turn; before a slot is written
    again, the event recorded after its last copy is waited on, so the caller's array may be
    reused as soon as `copy_from_host` returns while the GPU runs ahead. Larger uploads, and
    any upload read from files, go through `bulk` (`BulkUploads`), or without it the driver's
    pageable path (which stages and returns once the source has been read); larger downloads
    take the pageable path. An upload `bulk` only queued (read from files) reaches the stream
    at `flush`, which every other copy here calls first and `CudaRuntime` calls before handing
    out the stream (or launching).
    """

    def __init__(
        self, stream_handle: int, num_slots: int = 8, slot_bytes: int = 2 << 20, bulk: BulkUploads | None = None
    ) -> None:
        self.slot_bytes = slot_bytes
        self._bulk = bulk
        # Truthy while bulk uploads wait, not yet on the stream: a test per launch must be cheap.
        self.queued: Sized = bulk.queued if bulk is not None else ()
        self._stream = stream_handle
        self._base = int(check("cuMemHostAlloc", cu.cuMemHostAlloc(num_slots * slot_bytes, 0)))
        buffer = (ctypes.c_uint8 * (num_slots * slot_bytes)).from_address(self._base)
        self._host = np.ctypeslib.as_array(buffer)
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events = [check("cuEventCreate", cu.cuEventCreate(flags)) for _ in range(num_slots)]
        self._used = [False] * num_slots
        self._next = 0

    def upload(self, device_address: int, data: np.ndarray) -> None:
        """Enqueue a copy of the contiguous `data` to `device_address` on the stream."""
        self.upload_pieces(device_address, [data])

    def upload_pieces(self, device_address: int, pieces: Sequence[np.ndarray]) -> None:
        """Enqueue a copy of the contiguous `pieces`, laid end to end from `device_address`
        (a fused projection's parts, straight from the checkpoint with no host concatenation)."""
        num_bytes = sum(piece.nbytes for piece in pieces)
        bulk = self._bulk
        # A small tensor read from the checkpoint's files (a norm) joins the bulk queue too:
        # a slot of ours would flush the queue first and drain the threads at every layer.
        if bulk is not None and (num_bytes > self.slot_bytes or (num_bytes and bulk.queues(pieces))):
            bulk.upload(device_address, pieces)
            return
        self.flush()
        offset = 0
        for piece in pieces:
            self._upload_one(device_address + offset, piece)
            offset += piece.nbytes

    @property
    def bulk_stats(self) -> RingStats | None:
        """The bulk ring's counters (None without one)."""
        return self._bulk.stats if self._bulk is not None else None

    def flush(self) -> None:
        """Put every queued bulk upload on the stream, ahead of whatever is enqueued next.
        Raises what a queued read raised (those uploads are lost)."""
        if self.queued and self._bulk is not None:
            self._bulk.flush()

    def _upload_one(self, device_address: int, data: np.ndarray) -> None:
        num_bytes = data.nbytes
        if num_bytes == 0:
            return
        if num_bytes > self.slot_bytes:
            check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(device_address, data.ctypes.data, num_bytes, self._stream))
            return
        slot = self._take_slot()
        start = slot * self.slot_bytes
        self._host[start : start + num_bytes] = data.reshape(-1).view(np.uint8)
        check(
            "cuMemcpyHtoDAsync",
            cu.cuMemcpyHtoDAsync(device_address, self._base + start, num_bytes, self._stream),
        )
        check("cuEventRecord", cu.cuEventRecord(self._events[slot], self._stream))
        self._used[slot] = True

    def download(self, device_address: int, out: np.ndarray) -> None:
        """Copy into the contiguous `out` after everything enqueued so far (synchronises)."""
        self.flush()
        num_bytes = out.nbytes
        if num_bytes == 0:
            return
        if num_bytes > self.slot_bytes:
            check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(out.ctypes.data, device_address, num_bytes, self._stream))
            check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream))
            return
        slot = self._take_slot()
        start = slot * self.slot_bytes
        check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(self._base + start, device_address, num_bytes, self._stream))
        check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream))
        out.reshape(-1).view(np.uint8)[...] = self._host[start : start + num_bytes]

    def close(self) -> None:
        if self._bulk is not None:
            self._bulk.close()
        for event in self._events:
            cu.cuEventDestroy(event)
        cu.cuMemFreeHost(self._base)

    def _take_slot(self) -> int:
        slot = self._next
        self._next = (slot + 1) % len(self._events)
        if self._used[slot]:
            check("cuEventSynchronize", cu.cuEventSynchronize(self._events[slot]))
            self._used[slot] = False
        return slot


class PinnedMirror:
    """`HostMirror` on CUDA: page-locked host memory the shape of a device buffer, whose rows
    `upload` copies in with one cuMemcpyHtoDAsync (no staging slot; in a graph, a memcpy node
    that reads the memory at replay), each copy followed by an event record (an event node in a
    graph) that `wait_uploaded` waits for. Once the mirror is garbage, its memory and event go
    to `retired` for the runtime to free (`free_pinned`, on a thread with the context current)."""

    def __init__(self, device_address: int, shape: tuple[int, ...], dtype: np.dtype,
                 enqueue: Callable[[int, int, int, object], None], retired: list[tuple[int, object]],
                 make_current: Callable[[], None]) -> None:
        dtype = np.dtype(dtype)
        self._device_address = device_address
        self._enqueue = enqueue
        self._make_current = make_current  # `wait_uploaded` may be a thread's first call
        self._row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        num_bytes = max(1, shape[0] * self._row_bytes)
        self._base = int(check("cuMemHostAlloc", cu.cuMemHostAlloc(num_bytes, 0)))
        self._event = check("cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        self._retire = weakref.finalize(self, retired.append, (self._base, self._event))
        buffer = (ctypes.c_uint8 * num_bytes).from_address(self._base)
        self.array = np.ctypeslib.as_array(buffer)[: shape[0] * self._row_bytes].view(dtype).reshape(shape)
        self.array[...] = 0
        self._recorded = False

    def upload(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.array.shape[0]:
            raise ValueError(f"upload: rows {start}..{stop} of a mirror of {self.array.shape[0]}")
        if stop > start:
            offset = start * self._row_bytes
            self._enqueue(self._device_address + offset, self._base + offset, (stop - start) * self._row_bytes,
                          self._event)
            self._recorded = True

    def wait_uploaded(self) -> None:
        if self._recorded:
            self._make_current()
            check("cuEventSynchronize", cu.cuEventSynchronize(self._event))

    def retire(self) -> None:
        """Hand the memory to `retired` now (the runtime's close): the mirror is unusable after."""
        self._retire()


def free_pinned(retired: list[tuple[int, object]]) -> None:
    """Free the memory and events of garbage `PinnedMirror`s (after their last copies ran)."""
    while retired:
        base, event = retired.pop()
        cu.cuEventSynchronize(event)
        cu.cuEventDestroy(event)
        cu.cuMemFreeHost(base)


class PinnedDownloads:
    """Asynchronous device-to-host copies into a ring of page-locked slots.

    `begin` enqueues the copy and records an event; `PendingCopy.wait` waits for that event
    only, so the host can read step N's ids while step N+1 is already queued behind it. A slot
    is reused after `num_slots` later copies; a copy not waited for by then is reported lost.
    A copy larger than a slot (whole logits, for tests and benchmarks) is made at once instead.
    `PendingCopy.wait` may be called from another thread than the one that began the copy (the
    engine's mask thread waits for a step's ids): `make_current` makes the device's context
    current on the waiting thread (`CudaRuntime.ensure_current`).
    """

    def __init__(self, stream_handle: int, num_slots: int = 32, slot_bytes: int = 1 << 20,
                 make_current: Callable[[], None] | None = None) -> None:
        self.slot_bytes = slot_bytes
        self._stream = stream_handle
        self._make_current = make_current
        self._base = int(check("cuMemHostAlloc", cu.cuMemHostAlloc(num_slots * slot_bytes, 0)))
        buffer = (ctypes.c_uint8 * (num_slots * slot_bytes)).from_address(self._base)
        self._host = np.ctypeslib.as_array(buffer)
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events = [check("cuEventCreate", cu.cuEventCreate(flags)) for _ in range(num_slots)]
        self._generations = [0] * num_slots
        self._next = 0

    def begin(self, device_address: int, shape: tuple[int, ...], dtype: np.dtype) -> PendingCopy | CompletedCopy:
        num_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if num_bytes > self.slot_bytes:  # logits for a test or a bench: copy now, synchronously
            out = np.empty(shape, dtype)
            check("cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync(out.ctypes.data, device_address, num_bytes, self._stream))
            check("cuStreamSynchronize", cu.cuStreamSynchronize(self._stream))
            return CompletedCopy(out)
        slot = self._next
        self._next = (slot + 1) % len(self._events)
        check("cuEventSynchronize", cu.cuEventSynchronize(self._events[slot]))  # its last copy has landed
        self._generations[slot] += 1
        start = slot * self.slot_bytes
        if num_bytes:
            check(
                "cuMemcpyDtoHAsync",
                cu.cuMemcpyDtoHAsync(self._base + start, device_address, num_bytes, self._stream),
            )
        check("cuEventRecord", cu.cuEventRecord(self._events[slot], self._stream))
        return PendingCopy(self, slot, self._generations[slot], shape, np.dtype(dtype), start, num_bytes)

    def finish(self, copy: PendingCopy) -> np.ndarray:
        if self._generations[copy.slot] != copy.generation:
            raise RuntimeError("a device-to-host copy was not waited for before its slot was reused")
        if self._make_current is not None:  # (once a thread: `CudaRuntime.ensure_current`)
            self._make_current()
        check("cuEventSynchronize", cu.cuEventSynchronize(self._events[copy.slot]))
        raw = self._host[copy.start : copy.start + copy.num_bytes].copy()
        return raw.view(copy.dtype).reshape(copy.shape)

    def close(self) -> None:
        for event in self._events:
            cu.cuEventDestroy(event)
        cu.cuMemFreeHost(self._base)


class CompletedCopy:
    """A copy larger than a slot, made synchronously by `PinnedDownloads.begin`."""

    __slots__ = ("_result",)

    def __init__(self, result: np.ndarray) -> None:
        self._result = result

    def wait(self) -> np.ndarray:
        return self._result


class PendingCopy:
    """One `PinnedDownloads.begin`; `wait()` returns the host array (the same one every call)."""

    __slots__ = ("_owner", "slot", "generation", "shape", "dtype", "start", "num_bytes", "_result")

    def __init__(self, owner: PinnedDownloads, slot: int, generation: int, shape, dtype, start: int, num_bytes: int):
        self._owner = owner
        self.slot = slot
        self.generation = generation
        self.shape = shape
        self.dtype = dtype
        self.start = start
        self.num_bytes = num_bytes
        self._result: np.ndarray | None = None

    def wait(self) -> np.ndarray:
        if self._result is None:
            self._result = self._owner.finish(self)
        return self._result
