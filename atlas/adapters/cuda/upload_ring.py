"""Large host-to-device copies (the weights at load) through a ring of page-locked slots.

One copy from a memory-mapped checkpoint on one core is what bounds a load, so the source is cut
into chunks that several threads copy into the slots at once (both ways below release the GIL),
while the calling thread hands each filled slot to the DMA engine in order:

    sources (the rows of q | k | v, laid end to end on the device)
      |  plan_chunks: each piece cut into chunks of at most one slot, ~total / num_threads each
      v
    copy threads:   c0 -> slot 0   c1 -> slot 1   c2 -> slot 2   ...   (os.preadv or np.copyto)
    caller thread:  send(slot 0)   send(slot 1)   send(slot 2)   ...   (in order, as copies land)
    device:         DMA slot -> device; `wait(slot)` returns once it has landed

A source that is a view of an `np.memmap` (a safetensors tensor) is read from its file at the
view's offset with `os.preadv` straight into the slot: the kernel copies from the page cache, so
no thread faults the map in page by page (each fault takes the process's memory-map lock, which
many threads then queue on). Any other source is copied with `np.copyto`.

A slot is written again only after `wait` on its last send, and only the caller's thread talks
to the device, so the copy threads need no CUDA context. An upload of arrays in memory returns
once every chunk is sent: the sources have been read (they may be changed or freed), the DMAs
may still run. An upload read wholly from files returns once its chunks are queued, so the
threads stay busy across a checkpoint's many small tensors instead of draining after each; its
chunks are sent by the next uploads or by `flush`, which whoever enqueues other device work
must call first (`PinnedStaging.flush`, called by `CudaRuntime` before any stream operation).

This module holds no CUDA call: `memory.BulkUploads` gives it the page-locked slots and a
`SlotTransport` over the driver; the unit tests give it a fake device.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_CHUNK_ALIGN_BYTES = 4096  # page-sized chunks keep every copy but a piece's last page-aligned
MIN_CHUNK_BYTES = 1 << 20  # below this a thread's hand-off costs more than the copy
MAX_THREADS = 12


def upload_threads(num_cores: int | None = None) -> int:
    """Copy threads for a machine of `num_cores` (default: this one's): three quarters of the
    cores, at most `MAX_THREADS`, at least one (the rest stay with the loading thread and the
    DMA's driver thread; the API process has finished its imports by the time weights load)."""
    cores = num_cores if num_cores is not None else (os.cpu_count() or 2)
    return max(1, min(MAX_THREADS, cores * 3 // 4))


@dataclass(frozen=True, slots=True)
class FileExtent:
    """Where an array's bytes lie in a file: from byte `offset` of `path`."""

    path: str
    offset: int


def file_extent(array: np.ndarray) -> FileExtent | None:
    """The file bytes behind a C-contiguous view of an `np.memmap` (through any slices, dtype
    views and reshapes); None for any other array, a copy-on-write map (its writes are not in
    the file), or where `os.preadv` is missing."""
    if not hasattr(os, "preadv") or not array.flags.c_contiguous or array.nbytes == 0:
        return None
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or not isinstance(root.base, mmap.mmap) or root.filename is None:
        return None
    if root.mode == "c":
        return None
    return FileExtent(os.fspath(root.filename), array.ctypes.data - root.ctypes.data + root.offset)


def read_into(fd: int, target: np.ndarray, offset: int) -> None:
    """Fill `target` (a contiguous uint8 slot) from byte `offset` of the open file `fd`.
    Raises OSError when the file ends first (a checkpoint truncated since its header was read)."""
    view = memoryview(target)
    done = 0
    while done < len(view):
        num_read = os.preadv(fd, [view[done:]], offset + done)
        if num_read == 0:
            raise OSError(f"the file ends at byte {offset + done}, before the tensor's last byte {offset + len(view)}")
        done += num_read


class SlotTransport(Protocol):
    """The device side of the ring: DMA from a slot, and completion per slot."""

    def send(self, slot: int, num_bytes: int, device_address: int) -> None:
        """Enqueue the copy of the slot's first `num_bytes` to `device_address` (in the order
        of the calls), marking the slot so that `wait(slot)` returns once the copy has landed."""
        ...

    def wait(self, slot: int) -> None:
        """Block until the slot's last `send` has landed (returns at once if it has)."""
        ...


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes [start, stop) of source piece `piece`, sent to the destination's byte `offset`."""

    piece: int
    start: int
    stop: int
    offset: int

    @property
    def num_bytes(self) -> int:
        return self.stop - self.start


def plan_chunks(piece_bytes: Sequence[int], num_threads: int, slot_bytes: int) -> list[Chunk]:
    """Cut pieces laid end to end into chunks of at most `slot_bytes`, about total / num_threads
    each (so a mid-sized tensor still keeps every thread busy) but at least `MIN_CHUNK_BYTES`,
    page-aligned; a chunk never spans two pieces. Empty pieces give no chunk."""
    total = sum(piece_bytes)
    share = -(-total // max(num_threads, 1))
    chunk_bytes = max(MIN_CHUNK_BYTES, -(-share // _CHUNK_ALIGN_BYTES) * _CHUNK_ALIGN_BYTES)
    chunk_bytes = min(chunk_bytes, slot_bytes)
    chunks = []
    offset = 0
    for index, size in enumerate(piece_bytes):
        for start in range(0, size, chunk_bytes):
            stop = min(start + chunk_bytes, size)
            chunks.append(Chunk(index, start, stop, offset + start))
        offset += size
    return chunks


@dataclass(slots=True)
class RingStats:
    """What the ring did since it was made: bytes sent, bytes of those read from files,
    uploads left in flight on return (file-backed), and the caller's thread's seconds blocked
    on a chunk's copy or read (the threads are the bound) vs on a slot's DMA (the DMA is)."""

    num_bytes: int = 0
    file_bytes: int = 0
    num_deferred: int = 0
    read_wait_s: float = 0.0
    slot_wait_s: float = 0.0

    def describe(self) -> str:
        return (
            f"ring {self.num_bytes / 1e9:.2f} GB ({self.file_bytes / 1e9:.2f} from files), "
            f"waited {self.read_wait_s:.2f} s on reads, {self.slot_wait_s:.2f} s on slots"
        )


class UploadRing:
    """`num_slots` slots of `slot_bytes` in `host` (uint8, page-locked for real DMA), filled by
    `num_threads` threads with `read(fd, target, offset)` for a source with a `file_extent`
    (`read_into`; with `read_files` only), else `copy(target, source)` (np.copyto); tests
    inject their own. The files stay open until `close`.

    An upload whose every piece is read from a file returns once its chunks are queued: its
    bytes stay valid in the file, so the threads keep reading it while the caller moves on to
    the next tensor, and its slots are sent (in order, on the caller's thread) by later uploads
    or by `flush`. The device therefore sees such an upload only after `flush` (or a later
    upload of another source, which flushes first): whoever enqueues other work on the same
    stream must call `flush` before it."""

    def __init__(
        self,
        host: np.ndarray,
        slot_bytes: int,
        transport: SlotTransport,
        num_threads: int,
        copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto,
        read: Callable[[int, np.ndarray, int], None] = read_into,
        read_files: bool = True,
    ) -> None:
        if host.dtype != np.uint8 or host.ndim != 1 or host.nbytes < slot_bytes:
            raise ValueError(f"the ring needs a flat uint8 buffer of at least one slot ({slot_bytes} bytes)")
        self.slot_bytes = slot_bytes
        self.num_slots = host.nbytes // slot_bytes
        self.num_threads = max(1, num_threads)
        self.stats = RingStats()
        self._host = host
        self._transport = transport
        self._copy = copy
        self._read = read if read_files else None
        self._files: dict[str, int] = {}  # path -> fd, opened by the caller's thread only
        self._in_flight = [False] * self.num_slots  # sent, not yet waited for
        self._next = 0
        # Chunks whose copy was submitted but whose slot is not sent yet, in slot order: at
        # most `num_slots`, the oldest one's slot is the next to take when the ring is full.
        self._pending: deque[tuple[Future, int, int, int]] = deque()  # (copy, slot, bytes, device address)
        self._threads = ThreadPoolExecutor(max_workers=self.num_threads, thread_name_prefix="atlas-upload")

    @property
    def has_pending(self) -> bool:
        """Whether chunks wait to be sent: the device has not got every upload yet."""
        return bool(self._pending)

    @property
    def queued(self) -> Sized:
        """The queue of unsent chunks itself (always the same object, so a hot path may keep
        it and test its truth: non-empty while `flush` has work). Read only."""
        return self._pending

    def queues(self, pieces: Sequence[np.ndarray]) -> bool:
        """Whether `upload` would only queue these pieces (every one read from a file)."""
        return self._read is not None and all(file_extent(piece) is not None for piece in pieces)

    def upload(self, device_address: int, pieces: Sequence[np.ndarray]) -> None:
        """Copy the contiguous `pieces`, laid end to end from `device_address`. When every
        piece has a file extent (and `read_files`), returns once its chunks are queued (see the
        class doc); else first sends every earlier queued chunk, then returns once every byte
        has been read from the pieces (they may then be changed or freed) and its DMA enqueued.
        A copy or read that raises is raised here or at `flush`, whichever sends its chunk,
        after every other queued copy has stopped; the queued chunks are then dropped (their
        uploads never land: the load has failed) and the ring stays usable."""
        sources = [piece.reshape(-1).view(np.uint8) for piece in pieces]
        extents = [file_extent(piece) if self._read is not None else None for piece in pieces]
        deferred = all(extent is not None for extent in extents)
        if not deferred:
            self.flush()
        try:
            for chunk in plan_chunks([source.nbytes for source in sources], self.num_threads, self.slot_bytes):
                if len(self._pending) == self.num_slots:  # the next slot's copy is the oldest pending
                    self._send_oldest()
                slot = self._take_slot()
                target = self._host[slot * self.slot_bytes :][: chunk.num_bytes]
                extent = extents[chunk.piece]
                if extent is not None:
                    fd = self._open(extent.path)
                    future = self._threads.submit(self._read, fd, target, extent.offset + chunk.start)
                    self.stats.file_bytes += chunk.num_bytes
                else:
                    future = self._threads.submit(self._copy, target, sources[chunk.piece][chunk.start : chunk.stop])
                self._pending.append((future, slot, chunk.num_bytes, device_address + chunk.offset))
                while self._pending and self._pending[0][0].done():
                    self._send_oldest()
        except BaseException:
            self._drop_pending()
            raise
        if deferred:
            self.stats.num_deferred += 1
        else:
            self.flush()

    def flush(self) -> None:
        """Send every queued chunk (blocking on its copy): once this returns, every upload so
        far is enqueued on the device, ordered before whatever is enqueued next. Raises what a
        queued copy raised (see `upload`)."""
        try:
            while self._pending:
                self._send_oldest()
        except BaseException:
            self._drop_pending()
            raise

    def close(self) -> None:
        """Send what is queued, stop the threads, close the files and wait for every DMA still
        in flight. Raises what a queued copy raised, after all of that."""
        try:
            self.flush()
        finally:
            self._threads.shutdown()
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
            for slot, in_flight in enumerate(self._in_flight):
                if in_flight:
                    self._transport.wait(slot)
                    self._in_flight[slot] = False

    def _open(self, path: str) -> int:
        fd = self._files.get(path)
        if fd is None:
            fd = self._files[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd

    def _take_slot(self) -> int:
        slot = self._next
        self._next = (slot + 1) % self.num_slots
        if self._in_flight[slot]:
            started = time.perf_counter()
            self._transport.wait(slot)
            self.stats.slot_wait_s += time.perf_counter() - started
            self._in_flight[slot] = False
        return slot

    def _send_oldest(self) -> None:
        future, slot, num_bytes, device_address = self._pending[0]
        if not future.done():
            started = time.perf_counter()
            future.result()
            self.stats.read_wait_s += time.perf_counter() - started
        future.result()  # raises the copy's error, the chunk still counted as pending
        self._pending.popleft()
        self._transport.send(slot, num_bytes, device_address)
        self._in_flight[slot] = True
        self.stats.num_bytes += num_bytes

    def _drop_pending(self) -> None:
        """After an error: let no thread write a slot later, and forget the unsent chunks (their
        slots were never sent, so they are free)."""
        for future, _, _, _ in self._pending:
            future.exception()
        self._pending.clear()
