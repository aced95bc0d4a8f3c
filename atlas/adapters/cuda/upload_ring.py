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
to the device, so the copy threads need no CUDA context. `upload` returns once every chunk is
sent: the sources have been read (they may be changed or freed), the DMAs may still run.

This module holds no CUDA call: `memory.BulkUploads` gives it the page-locked slots and a
`SlotTransport` over the driver; the unit tests give it a fake device.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Callable, Sequence
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


class UploadRing:
    """`num_slots` slots of `slot_bytes` in `host` (uint8, page-locked for real DMA), filled by
    `num_threads` threads with `read(fd, target, offset)` for a source with a `file_extent`
    (`read_into`; with `read_files` only), else `copy(target, source)` (np.copyto); tests
    inject their own. The files stay open until `close`."""

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
        self._host = host
        self._transport = transport
        self._copy = copy
        self._read = read if read_files else None
        self._files: dict[str, int] = {}  # path -> fd, opened by the caller's thread only
        self._in_flight = [False] * self.num_slots  # sent, not yet waited for
        self._next = 0
        self._threads = ThreadPoolExecutor(max_workers=self.num_threads, thread_name_prefix="atlas-upload")

    def upload(self, device_address: int, pieces: Sequence[np.ndarray]) -> None:
        """Copy the contiguous `pieces`, laid end to end from `device_address`. Returns once
        every byte has been read from them and its DMA enqueued. A copy that raises is raised
        here, after the other chunks' copies have stopped (the ring stays usable)."""
        sources = [piece.reshape(-1).view(np.uint8) for piece in pieces]
        extents = [file_extent(piece) if self._read is not None else None for piece in pieces]
        pending: deque[tuple[Future, int, Chunk]] = deque()
        try:
            for chunk in plan_chunks([source.nbytes for source in sources], self.num_threads, self.slot_bytes):
                if len(pending) == self.num_slots:  # the next slot's copy is the oldest pending
                    self._send(pending.popleft(), device_address)
                slot = self._take_slot()
                target = self._host[slot * self.slot_bytes :][: chunk.num_bytes]
                extent = extents[chunk.piece]
                if extent is not None:
                    fd = self._open(extent.path)
                    future = self._threads.submit(self._read, fd, target, extent.offset + chunk.start)
                else:
                    future = self._threads.submit(self._copy, target, sources[chunk.piece][chunk.start : chunk.stop])
                pending.append((future, slot, chunk))
                while pending and pending[0][0].done():
                    self._send(pending.popleft(), device_address)
            while pending:
                self._send(pending.popleft(), device_address)
        finally:
            for future, _, _ in pending:  # only after an error: let no thread write a slot later
                future.exception()

    def close(self) -> None:
        """Stop the threads, close the files and wait for every DMA still in flight."""
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
            self._transport.wait(slot)
            self._in_flight[slot] = False
        return slot

    def _send(self, entry: tuple[Future, int, Chunk], device_address: int) -> None:
        future, slot, chunk = entry
        future.result()
        self._transport.send(slot, chunk.num_bytes, device_address + chunk.offset)
        self._in_flight[slot] = True
