"""Reading a rank's part of a checkpoint, and what one rank holds: deferred tensors stay unread
through the loader's stacking, parts are the right elements, placements follow the ranks."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.cuda.upload_ring import file_extent
from atlas.adapters.weights.safetensors import SafetensorsWeights, write_safetensors
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.shard_reads import Deferred, DeferredWeights, RowStack, read_part, row_blocks
from atlas.domain.models.sharding import ShardingError, linear_rows, row_projection
from atlas.domain.parallel import RankPlacement
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm
from fakes import DictWeights


def test_a_part_keeps_the_ranges_of_each_dimension_in_order():
    array = np.arange(8 * 6).reshape(8, 6)
    np.testing.assert_array_equal(read_part(array, [[(0, 2), (6, 8)], None]), array[[0, 1, 6, 7]])
    np.testing.assert_array_equal(read_part(array, [None, [(4, 6)]]), array[:, 4:6])
    np.testing.assert_array_equal(read_part(array, [[(1, 3)], [(0, 1), (5, 6)]]), array[1:3][:, [0, 5]])
    with pytest.raises(ValueError, match="outside"):
        read_part(array, [[(6, 9)]])


def test_the_loaders_stack_stays_deferred_and_reads_only_a_ranks_rows(tmp_path):
    q, k = np.arange(32, dtype=np.float32).reshape(8, 4), 100 + np.arange(16, dtype=np.float32).reshape(4, 4)
    write_safetensors(tmp_path / "model.safetensors", {"q": q, "k": k})
    reader = CheckpointReader(DeferredWeights(SafetensorsWeights(tmp_path)))
    stacked = reader.stacked([("q", (8, 4)), ("k", (4, 4))])
    assert isinstance(stacked, RowStack) and stacked.shape == (12, 4)
    assert isinstance(stacked.parts[0], Deferred) and isinstance(stacked.parts[0].view, np.memmap)
    np.testing.assert_array_equal(read_part(stacked, [[(2, 4), (9, 11)], [(1, 3)]]),
                                  np.concatenate([q, k])[[2, 3, 9, 10]][:, 1:3])
    np.testing.assert_array_equal(np.asarray(stacked), np.concatenate([q, k]))


def test_one_devices_stack_keeps_the_checkpoints_views_for_the_backend_to_upload_block_by_block(tmp_path):
    q, k, v = (np.arange(32, dtype=np.float32).reshape(8, 4) + 100 * i for i in range(3))
    write_safetensors(tmp_path / "model.safetensors", {"q": q, "k": k[:4], "v": v[:4]})
    source = SafetensorsWeights(tmp_path)
    reader = CheckpointReader(source)
    stacked = reader.stacked([("q", (8, 4)), ("k", (4, 4)), ("v", (4, 4))])
    assert isinstance(stacked, RowStack) and stacked.shape == (16, 4)
    blocks = row_blocks(stacked)
    assert [block.shape for block in blocks] == [(8, 4), (4, 4), (4, 4)]
    assert all(isinstance(block.base, np.memmap) or isinstance(block, np.memmap) for block in blocks)  # no copy
    expected = np.concatenate([q, k[:4], v[:4]])
    np.testing.assert_array_equal(np.concatenate(blocks), expected)
    np.testing.assert_array_equal(np.asarray(stacked), expected)
    np.testing.assert_array_equal(np.asarray(stacked, np.float64), expected)
    # One tensor (o_proj, down_proj, the LM head) is the checkpoint's view itself, not a host
    # copy: the upload then reads it from its file (a copy cost the 8B's load 5.9 GB of memcpy).
    single = reader.stacked([("q", (8, 4))])
    assert file_extent(single) == file_extent(source.get("q")) is not None
    assert [block.shape for block in row_blocks(RowStack([stacked, q]))] == [(8, 4), (4, 4), (4, 4), (8, 4)]
    experts = reader.experts([[("q", (8, 4)), ("k", (4, 4))], [("q", (8, 4)), ("v", (4, 4))]])
    assert isinstance(experts, np.ndarray) and experts.shape == (2, 12, 4)  # plain arrays stack at once


def test_numpy_on_a_deferred_tensor_reads_it_whole():
    weight = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    deferred = DeferredWeights(DictWeights({"w": weight})).get("w")
    np.testing.assert_array_equal(1 + deferred, 1 + weight)
    np.testing.assert_array_equal(deferred.reshape(4, 3), weight.reshape(4, 3))
    np.testing.assert_array_equal(deferred[:, 0], weight[:, 0])
    assert deferred.T.shape == (4, 3) and np.shape(deferred) == (3, 4)


def test_ranks_hold_contiguous_parts_and_fewer_kv_heads_replicate_next_to_their_queries():
    placements = [RankPlacement(rank, 4) for rank in range(4)]
    assert [p.split(32) for p in placements] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [p.kv_heads(8) for p in placements] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.kv_heads(2) for p in placements] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.carries_residual for p in placements] == [True, False, False, False]


def test_expert_groups_split_the_experts_and_share_each_experts_width():
    placements = [RankPlacement(rank, 4, expert_parallel=2) for rank in range(4)]
    assert [p.experts(8) for p in placements] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert [p.expert_width(64) for p in placements] == [(0, 32), (32, 64), (0, 32), (32, 64)]
    assert [RankPlacement(rank, 4, 4).experts(128) for rank in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    with pytest.raises(ValueError):
        RankPlacement(0, 4, 3)


def test_a_post_norm_on_a_row_parallel_product_is_refused_naming_it():
    projection = HostProjection(HostLinear(np.ones((4, 8), np.float32)), output_norm=RmsNorm(np.ones(4), 1e-6))
    with pytest.raises(ShardingError, match="a norm after it needs the whole sum"):
        row_projection(projection, (0, 4), RankPlacement(0, 2))


def test_quantization_blocks_split_with_their_rows_or_are_refused():
    linear = HostLinear(np.ones((256, 128), np.float32), scales=np.arange(2, dtype=np.float32).reshape(2, 1),
                        block_shape=(128, 128))
    part = linear_rows(linear, [(128, 256)])
    assert part.weight.shape == (128, 128) and part.scales.tolist() == [[1.0]]
    with pytest.raises(ShardingError, match="straddle"):
        linear_rows(linear, [(64, 192)])
    channel = HostLinear(np.ones((4, 2), np.float32), scales=np.arange(4, dtype=np.float32))
    assert linear_rows(channel, [(0, 1), (3, 4)]).scales.tolist() == [0.0, 3.0]


def test_an_expert_stack_reads_only_the_experts_and_rows_asked_for():
    rng = np.random.default_rng(0)
    tensors = {f"e{e}.{part}": rng.standard_normal((3, 2)).astype(np.float32) for e in range(4) for part in ("g", "u")}
    groups = [[(f"e{e}.g", (3, 2)), (f"e{e}.u", (3, 2))] for e in range(4)]
    whole = CheckpointReader(DictWeights(tensors)).experts(groups)
    deferred = CheckpointReader(DeferredWeights(DictWeights(tensors))).experts(groups)
    assert isinstance(whole, np.ndarray) and whole.shape == (4, 6, 2) and deferred.shape == (4, 6, 2)
    expected = whole[2:4][:, [1, 2, 4, 5]]
    np.testing.assert_array_equal(read_part(deferred, [[(2, 4)], [(1, 3), (4, 6)], None]), expected)
    np.testing.assert_array_equal(read_part(whole, [[(2, 4)], [(1, 3), (4, 6)], None]), expected)
