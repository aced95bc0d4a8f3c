"""The weights' upload ring on the CPU: a fake device whose DMAs land late, on their own thread,
reading the slot when they run (as a real DMA does), so a slot written too early corrupts."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from atlas.adapters.cuda.upload_ring import (
    MIN_CHUNK_BYTES,
    Chunk,
    FileExtent,
    UploadRing,
    file_extent,
    plan_chunks,
    read_into,
    upload_threads,
)

MIB = 1 << 20


class LateDevice:
    """A stream of DMAs run in order on one thread, each after a short delay."""

    def __init__(self, host: np.ndarray, slot_bytes: int, device_bytes: int, delay_s: float = 0.002) -> None:
        self.memory = np.zeros(device_bytes, np.uint8)
        self._host = host
        self._slot_bytes = slot_bytes
        self._delay_s = delay_s
        self._stream = ThreadPoolExecutor(max_workers=1)
        self._last: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.busy: set[int] = set()  # slots whose DMA has not landed
        self.num_sends = 0

    def send(self, slot: int, num_bytes: int, device_address: int) -> None:
        with self._lock:
            self.busy.add(slot)
        self.num_sends += 1
        self._last[slot] = self._stream.submit(self._dma, slot, num_bytes, device_address)

    def wait(self, slot: int) -> None:
        if slot in self._last:
            self._last[slot].result()

    def drain(self) -> None:
        for future in self._last.values():
            future.result()

    def slot_of(self, target: np.ndarray) -> int:
        return (target.ctypes.data - self._host.ctypes.data) // self._slot_bytes

    def _dma(self, slot: int, num_bytes: int, device_address: int) -> None:
        time.sleep(self._delay_s)
        start = slot * self._slot_bytes
        self.memory[device_address : device_address + num_bytes] = self._host[start : start + num_bytes]
        with self._lock:
            self.busy.discard(slot)


def make_ring(num_slots: int, slot_bytes: int, num_threads: int, device_bytes: int, reads: list | None = None):
    host = np.zeros(num_slots * slot_bytes, np.uint8)
    device = LateDevice(host, slot_bytes, device_bytes)
    overwritten: list[int] = []

    def checked_copy(target: np.ndarray, source: np.ndarray) -> None:
        slot = device.slot_of(target)
        if slot in device.busy:
            overwritten.append(slot)
        np.copyto(target, source)

    def checked_read(fd: int, target: np.ndarray, offset: int) -> None:
        slot = device.slot_of(target)
        if slot in device.busy:
            overwritten.append(slot)
        if reads is not None:
            reads.append((offset, target.nbytes))
        read_into(fd, target, offset)

    ring = UploadRing(host, slot_bytes, device, num_threads, copy=checked_copy, read=checked_read)
    return ring, device, overwritten


def test_chunks_split_a_tensor_over_the_threads_and_never_span_two_pieces():
    chunks = plan_chunks([8 * MIB, 0, 4 * MIB - 5], num_threads=4, slot_bytes=4 * MIB)
    share = 3 * MIB  # ceil((12 MiB - 5) / 4) rounded up to whole pages
    assert chunks == [
        Chunk(0, 0, share, 0),
        Chunk(0, share, 2 * share, share),
        Chunk(0, 2 * share, 8 * MIB, 2 * share),
        Chunk(2, 0, share, 8 * MIB),
        Chunk(2, share, 4 * MIB - 5, 8 * MIB + share),
    ]
    assert [c.num_bytes for c in plan_chunks([64 * MIB], num_threads=2, slot_bytes=8 * MIB)] == [8 * MIB] * 8
    assert plan_chunks([MIB // 2, MIB // 2], num_threads=8, slot_bytes=8 * MIB) == [
        Chunk(0, 0, MIB // 2, 0),
        Chunk(1, 0, MIB // 2, MIB // 2),
    ]
    assert plan_chunks([3 * MIB], num_threads=16, slot_bytes=8 * MIB)[0].num_bytes == MIN_CHUNK_BYTES


def test_pieces_land_end_to_end_bit_exact_and_no_slot_is_written_before_its_dma_landed():
    rng = np.random.default_rng(7)
    sizes = [5 * MIB + 3, 1, 2 * MIB, 0, 7 * MIB + 4093]  # odd sizes, an empty piece, wraps the ring
    pieces = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    ring, device, overwritten = make_ring(num_slots=3, slot_bytes=MIB, num_threads=3, device_bytes=32 * MIB)
    ring.upload(4096, pieces)
    ring.upload(4096 + sum(sizes), [pieces[0][::-1].copy()])  # a second call reuses slots in flight
    ring.close()
    device.drain()
    expected = np.concatenate([*pieces, pieces[0][::-1]])
    assert np.array_equal(device.memory[4096 : 4096 + expected.nbytes], expected)
    assert not device.memory[:4096].any() and not device.memory[4096 + expected.nbytes :].any()
    assert overwritten == []
    assert device.num_sends == len(plan_chunks(sizes, 3, MIB)) + len(plan_chunks([sizes[0]], 3, MIB))


def test_sources_may_change_once_upload_returns():
    source = np.arange(6 * MIB, dtype=np.uint8)
    original = source.copy()
    ring, device, _ = make_ring(num_slots=2, slot_bytes=2 * MIB, num_threads=2, device_bytes=6 * MIB)
    ring.upload(0, [source])
    source[:] = 0  # the DMAs may still be running: they read the slots, not the source
    ring.close()
    device.drain()
    assert np.array_equal(device.memory, original)


def test_typed_pieces_upload_as_their_bytes():
    floats = np.linspace(-3.0, 3.0, 3 * 1024 * 512, dtype=np.float32).reshape(3, -1)
    ints = np.arange(1000, dtype=np.int32)
    ring, device, _ = make_ring(num_slots=4, slot_bytes=MIB, num_threads=2, device_bytes=8 * MIB)
    ring.upload(0, [floats, ints])
    ring.close()
    device.drain()
    assert np.array_equal(device.memory[: floats.nbytes].view(np.float32), floats.reshape(-1))
    assert np.array_equal(device.memory[floats.nbytes : floats.nbytes + ints.nbytes].view(np.int32), ints)


def test_a_failing_copy_is_raised_after_the_other_copies_stopped_and_the_ring_still_works():
    host = np.zeros(4 * MIB, np.uint8)
    device = LateDevice(host, MIB, 16 * MIB)
    calls = []

    def flaky(target: np.ndarray, source: np.ndarray) -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise OSError("the checkpoint's page could not be read")
        np.copyto(target, source)

    ring = UploadRing(host, MIB, device, num_threads=2, copy=flaky)
    with pytest.raises(OSError, match="could not be read"):
        ring.upload(0, [np.ones(6 * MIB, np.uint8)])
    ring.upload(8 * MIB, [np.full(3 * MIB, 9, np.uint8)])
    ring.close()
    device.drain()
    assert (device.memory[8 * MIB : 11 * MIB] == 9).all()


def test_a_buffer_smaller_than_a_slot_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        UploadRing(np.zeros(100, np.uint8), 4096, LateDevice(np.zeros(100, np.uint8), 4096, 0), 1)


def write_file(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_a_memmaps_views_know_their_file_offset_and_other_arrays_have_none(tmp_path):
    name = write_file(tmp_path / "w.bin", bytes(range(256)) * 64)
    mapped = np.memmap(name, dtype=np.uint8, mode="r")
    typed = mapped[100:612].view(np.uint16).reshape(16, 16)
    assert file_extent(typed) == FileExtent(os.path.abspath(name), 100)
    assert file_extent(np.ascontiguousarray(typed[2:4])) == FileExtent(os.path.abspath(name), 164)
    at_offset = np.memmap(name, dtype=np.uint8, mode="r", offset=5000)  # not on a page boundary
    assert file_extent(at_offset[10:20]) == FileExtent(os.path.abspath(name), 5010)
    assert file_extent(typed[:, ::2]) is None  # strided: not one extent
    assert file_extent(np.array(typed)) is None
    assert file_extent(np.memmap(name, dtype=np.uint8, mode="c")[:10]) is None  # its writes stay in memory


def test_memmapped_pieces_are_read_from_their_file_into_the_slots_bit_exact(tmp_path):
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 9 * MIB + 77, dtype=np.uint8)
    name = write_file(tmp_path / "model.safetensors", data.tobytes())
    mapped = np.memmap(name, dtype=np.uint8, mode="r")
    in_memory = rng.integers(0, 256, MIB + 5, dtype=np.uint8)
    pieces = [mapped[13 : 5 * MIB], in_memory, mapped[6 * MIB + 1 :].view(np.uint8)]
    reads: list[tuple[int, int]] = []
    ring, device, overwritten = make_ring(num_slots=3, slot_bytes=MIB, num_threads=3, device_bytes=16 * MIB, reads=reads)
    ring.upload(0, pieces)
    ring.close()
    device.drain()
    expected = np.concatenate([np.asarray(piece) for piece in pieces])
    assert np.array_equal(device.memory[: expected.nbytes], expected)
    assert overwritten == []
    assert sum(size for _, size in reads) == pieces[0].nbytes + pieces[2].nbytes  # the file pieces only
    assert min(offset for offset, _ in reads) == 13


def test_a_file_shorter_than_its_tensor_is_an_os_error(tmp_path):
    name = write_file(tmp_path / "short.bin", b"x" * 100)
    fd = os.open(name, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="ends at byte 100"):
            read_into(fd, np.zeros(64, np.uint8), 50)
    finally:
        os.close(fd)


def test_copy_threads_are_three_quarters_of_the_cores_up_to_twelve():
    assert [upload_threads(cores) for cores in (1, 2, 8, 16, 64)] == [1, 1, 6, 12, 12]


def test_a_checkpoints_fused_projection_blocks_are_read_from_the_file(tmp_path):
    """What `CudaGpuBackend.copy_from_host` hands the ring for a safetensors model: views with
    a file extent (else the load silently falls back to faulting in the map)."""
    from atlas.adapters.weights.safetensors import SafetensorsWeights, write_safetensors
    from atlas.domain.models.checkpoint import CheckpointReader
    from atlas.domain.models.shard_reads import row_blocks

    tensors = {name: np.full((rows, 64), index, np.float32) for index, (name, rows) in enumerate({"q": 8, "k": 2}.items())}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    stacked = CheckpointReader(SafetensorsWeights(tmp_path)).stacked([(name, t.shape) for name, t in tensors.items()])
    blocks = [np.ascontiguousarray(block, dtype=np.float32) for block in row_blocks(stacked)]
    extents = [file_extent(block) for block in blocks]
    assert all(extent is not None and extent.path.endswith("model.safetensors") for extent in extents)
    with open(tmp_path / "model.safetensors", "rb") as handle:
        for block, extent in zip(blocks, extents, strict=True):
            handle.seek(extent.offset)
            assert handle.read(block.nbytes) == block.tobytes()


def test_without_read_files_a_memmapped_piece_is_copied_out_of_the_map(tmp_path):
    name = write_file(tmp_path / "w.bin", bytes(range(256)) * 8192)
    mapped = np.memmap(name, dtype=np.uint8, mode="r")
    host = np.zeros(2 * MIB, np.uint8)
    device = LateDevice(host, MIB, 4 * MIB)
    copies: list[int] = []

    def counted_copy(target: np.ndarray, source: np.ndarray) -> None:
        copies.append(source.nbytes)
        np.copyto(target, source)

    def no_read(fd: int, target: np.ndarray, offset: int) -> None:
        raise AssertionError("read from the file although read_files is off")

    ring = UploadRing(host, MIB, device, 2, copy=counted_copy, read=no_read, read_files=False)
    ring.upload(0, [mapped[7:]])
    ring.close()
    device.drain()
    assert np.array_equal(device.memory[: mapped.nbytes - 7], mapped[7:]) and sum(copies) == mapped.nbytes - 7


def test_many_small_file_tensors_pipeline_across_uploads_and_land_exactly_with_arrays_between(tmp_path):
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, 24 * MIB, dtype=np.uint8)
    mapped = np.memmap(write_file(tmp_path / "model.safetensors", data.tobytes()), dtype=np.uint8, mode="r")
    ring, device, overwritten = make_ring(num_slots=4, slot_bytes=MIB, num_threads=3, device_bytes=64 * MIB)
    expected = np.zeros(64 * MIB, np.uint8)
    address, start = 0, 0
    for index, size in enumerate([4096, 3 * MIB + 5, 100, 2 * MIB, 1, 5 * MIB - 3, 64, MIB] * 2):
        if index % 5 == 4:  # an array in memory: sends everything queued before its own copy
            source = rng.integers(0, 256, size + 7, dtype=np.uint8)
            ring.upload(address, [source])
            assert not ring.has_pending
            expected[address : address + source.nbytes] = source
            source[:] = 0  # read by now
            address += source.nbytes
            continue
        pieces = [mapped[start : start + size], mapped[start + size : start + 2 * size + 1]]
        ring.upload(address, pieces)
        expected[address : address + 2 * size + 1] = data[start : start + 2 * size + 1]
        address, start = address + 2 * size + 1, (start + 2 * size + 1) % (12 * MIB)
    assert ring.stats.num_deferred > 0
    ring.flush()
    assert not ring.has_pending
    device.drain()
    assert np.array_equal(device.memory, expected)
    assert overwritten == []
    assert ring.stats.num_bytes == address and ring.stats.file_bytes < address
    ring.close()


def test_a_file_upload_reaches_the_device_only_at_flush_so_later_work_must_flush_first(tmp_path):
    """The ordering a kernel after the upload relies on: `CudaRuntime` flushes before any op."""
    data = np.arange(3 * MIB, dtype=np.uint8)
    mapped = np.memmap(write_file(tmp_path / "w.bin", data.tobytes()), dtype=np.uint8, mode="r")
    gate = threading.Event()

    def held_read(fd: int, target: np.ndarray, offset: int) -> None:
        gate.wait(5)
        read_into(fd, target, offset)

    host = np.zeros(8 * MIB, np.uint8)
    device = LateDevice(host, MIB, 4 * MIB)
    ring = UploadRing(host, MIB, device, num_threads=2, read=held_read)
    ring.upload(0, [mapped])
    assert ring.queued and device.num_sends == 0  # queued: a kernel enqueued now would run first
    gate.set()
    ring.flush()  # every chunk sent, in order: what is enqueued next runs after them
    assert not ring.queued and device.num_sends == 3
    device.drain()
    assert np.array_equal(device.memory[: data.nbytes], data)
    ring.close()


def test_a_failed_read_of_a_queued_upload_surfaces_by_flush_and_the_ring_still_works(tmp_path):
    data = np.arange(4 * MIB, dtype=np.uint8)
    mapped = np.memmap(write_file(tmp_path / "w.bin", data.tobytes()), dtype=np.uint8, mode="r")
    calls: list[int] = []

    def flaky(fd: int, target: np.ndarray, offset: int) -> None:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError("the checkpoint's page could not be read")
        read_into(fd, target, offset)

    host = np.zeros(8 * MIB, np.uint8)
    device = LateDevice(host, MIB, 16 * MIB)
    ring = UploadRing(host, MIB, device, num_threads=2, read=flaky)
    with pytest.raises(OSError, match="could not be read"):  # at whichever sends that chunk
        ring.upload(0, [mapped])
        ring.flush()
    assert not ring.has_pending
    ring.upload(8 * MIB, [mapped[: 2 * MIB]])
    ring.upload(12 * MIB, [np.full(MIB, 9, np.uint8)])  # an array: flushes the file upload first
    ring.close()
    device.drain()
    assert np.array_equal(device.memory[8 * MIB : 10 * MIB], data[: 2 * MIB])
    assert (device.memory[12 * MIB : 13 * MIB] == 9).all()


def test_a_failed_read_of_a_queued_upload_surfaces_by_the_next_upload_of_an_array(tmp_path):
    mapped = np.memmap(write_file(tmp_path / "w.bin", b"\1" * (2 * MIB)), dtype=np.uint8, mode="r")

    def failing(fd: int, target: np.ndarray, offset: int) -> None:
        raise OSError("gone")

    host = np.zeros(4 * MIB, np.uint8)
    device = LateDevice(host, MIB, 8 * MIB)
    ring = UploadRing(host, MIB, device, num_threads=2, read=failing)
    with pytest.raises(OSError, match="gone"):  # by the array's upload at the latest
        ring.upload(0, [mapped])
        ring.upload(4 * MIB, [np.ones(MIB, np.uint8)])
    ring.close()
    assert device.num_sends == 0


def test_only_uploads_read_wholly_from_files_are_queued(tmp_path):
    from atlas.adapters.weights.safetensors import SafetensorsWeights, write_safetensors

    write_safetensors(tmp_path / "model.safetensors", {"norm": np.ones(8, np.float32)})
    norm = SafetensorsWeights(tmp_path).get("norm")  # what the loader hands a backend
    host = np.zeros(MIB, np.uint8)
    ring = UploadRing(host, MIB, LateDevice(host, MIB, MIB), 1)
    assert ring.queues([norm]) and not ring.queues([norm, np.ones(8, np.float32)])
    assert not UploadRing(host, MIB, LateDevice(host, MIB, MIB), 1, read_files=False).queues([norm])
    ring.close()
