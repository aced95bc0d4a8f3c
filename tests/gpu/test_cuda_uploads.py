"""Weights reach the device bit for bit through the upload ring: fused projections uploaded block
by block from a memory-mapped checkpoint, odd sizes across many slots, sources changed at once."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.weights.safetensors import SafetensorsWeights, write_safetensors
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.shard_reads import RowStack
from atlas.ports.gpu import DType

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_a_fused_projection_from_the_checkpoint_lands_bit_exact(cuda_backend, tmp_path):
    rng = np.random.default_rng(3)
    hidden = 1024
    rows = {"q": 4096, "k": 1024, "v": 1024}  # 12 MiB in bf16: several ring slots
    tensors = {name: rng.standard_normal((count, hidden)).astype(ml_dtypes.bfloat16) for name, count in rows.items()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    reader = CheckpointReader(SafetensorsWeights(tmp_path))
    stacked = reader.stacked([(name, (count, hidden)) for name, count in rows.items()])
    assert isinstance(stacked, RowStack)
    on_device = cuda_backend.upload(stacked, DType.BF16)
    landed = cuda_backend.download(on_device)
    expected = np.concatenate(list(tensors.values()))
    assert np.array_equal(landed.view(np.uint16), expected.view(np.uint16))


def test_odd_sized_pieces_across_the_whole_ring_land_end_to_end(cuda_backend):
    rng = np.random.default_rng(5)
    sizes = [9 * MIB + 3, 1, 0, 200 * MIB + 4093, 3 * MIB]  # more than the ring holds, unaligned
    pieces = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    target = cuda_backend.empty((sum(sizes),), DType.U8)
    cuda_backend.runtime.staging.upload_pieces(target.address, pieces)
    expected = np.concatenate(pieces)
    for piece in pieces:
        piece[:] = 0  # the DMAs may still run: they read the ring, not the sources
    assert np.array_equal(cuda_backend.download(target), expected)


def test_a_float32_stack_converts_block_by_block(cuda_backend):
    rng = np.random.default_rng(9)
    parts = [rng.standard_normal((rows, 512)).astype(np.float32) for rows in (2048, 512, 512)]
    on_device = cuda_backend.upload(RowStack(parts), DType.BF16)
    expected = np.concatenate(parts).astype(ml_dtypes.bfloat16)
    assert np.array_equal(cuda_backend.download(on_device).view(np.uint16), expected.view(np.uint16))


def test_many_small_checkpoint_tensors_are_seen_by_a_kernel_launched_right_after(cuda_backend, tmp_path):
    """File uploads are only queued when `upload` returns (upload_ring.py): the next launch
    must put them on the stream first. No synchronize between the uploads and the kernels."""
    rng = np.random.default_rng(13)
    widths = [64, 4096, 1024, 8, 2048, 12288] * 6 + [1 << 20, 3 << 20, 64]  # norms to several slots
    tensors = {
        f"t{index}": rng.integers(0, 1 << 16, (4, width), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for index, width in enumerate(widths)
    }
    write_safetensors(tmp_path / "model.safetensors", tensors)
    weights = SafetensorsWeights(tmp_path)
    reverse = cuda_backend.upload(np.arange(4, dtype=np.int32)[::-1].copy(), DType.I32)
    gathered = {}
    for index, name in enumerate(tensors):
        table = cuda_backend.upload(weights.get(name), DType.BF16)
        if index % 3 == 2:
            continue  # left queued behind the next tensors
        gathered[name] = cuda_backend.empty(table.shape, DType.BF16)
        cuda_backend.gather_rows(table, reverse, gathered[name])  # reads the upload just queued
    for name, out in gathered.items():
        expected = tensors[name]
        assert np.array_equal(cuda_backend.download(out).view(np.uint16), expected[::-1].view(np.uint16))
