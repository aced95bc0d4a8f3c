"""A model declares the kernel kinds it calls and its cache groups; loading it on a backend that
lacks a kind fails before any weight is read, naming the kind."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import TINY_LLAMA, DictWeights, random_llama_weights

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.models.cache_groups import CacheGroupKind, CacheGroupSpec, KvShape, StateShape, group_caches, locate
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.ports.gpu import Kind, MissingKindError


class _WithoutAttention(MockGpuBackend):
    @property
    def capabilities(self):
        caps = super().capabilities
        return replace(caps, kinds=caps.kinds - {Kind.ATTENTION})


def test_a_backend_without_a_kind_the_model_needs_is_refused_before_any_weight_is_read():
    config = ModelConfig.from_dict(TINY_LLAMA)
    with pytest.raises(MissingKindError, match="LlamaForCausalLM needs the attention kernels.*mock backend"):
        load_model(config, DictWeights({}), _WithoutAttention(), 256)  # no tensors: reading one would fail


def test_a_llama_declares_dense_and_attention_and_one_kv_group_of_every_layer():
    config = ModelConfig.from_dict(dict(TINY_LLAMA, sliding_window=16))
    model = load_model(config, DictWeights(random_llama_weights(TINY_LLAMA)), MockGpuBackend(), 256)
    assert model.kinds == {Kind.DENSE, Kind.ATTENTION}
    shape = KvShape(config.num_kv_heads, config.head_dim, 16)
    assert model.cache_groups == (CacheGroupSpec(shape, tuple(range(config.num_layers))),)
    assert model.cache_groups[0].kind is CacheGroupKind.SLIDING_WINDOW and model.cache_groups[0].window == 16


def test_layers_with_the_same_per_sequence_state_share_a_group():
    full, sliding, state = KvShape(8, 128), KvShape(8, 128, 1024), StateShape(8192, 4, 32, 128, 128)
    groups = group_caches([full, sliding, sliding, full, state, None, state])
    assert [(g.shape, g.layers) for g in groups] == [(full, (0, 3)), (sliding, (1, 2)), (state, (4, 6))]
    assert [g.kind for g in groups] == [
        CacheGroupKind.FULL_ATTENTION, CacheGroupKind.SLIDING_WINDOW, CacheGroupKind.RECURRENT_STATE
    ]
    assert [locate(groups, layer) for layer in (0, 1, 2, 3, 4, 6)] == [(0, 0), (1, 0), (1, 1), (0, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="layer 5"):
        locate(groups, 5)


def test_each_group_gets_a_device_cache_one_page_past_its_pool_and_a_pool_of_its_own():
    """A hybrid declaration (full attention, a window, recurrent state): the device caches hold
    the pool's pages and the scratch page, FP8 scales go to the group of their layer, and the
    cache manager's pools follow the same counts."""
    from atlas.domain.cache.manager import CacheManager
    from atlas.domain.device_caches import allocate_caches, scratch_page
    from atlas.ports.gpu import DType

    full, window, state = KvShape(2, 16), KvShape(2, 16, 32), StateShape(48, 4, 2, 8, 8)
    groups = group_caches([full, window, state, full, state])
    scales = tuple((0.5 + layer, 1.0) for layer in range(5))
    caches = allocate_caches(MockGpuBackend(), groups, (6, 4, 3), 8, DType.FP8_E4M3, scales)
    assert [cache.spec.num_blocks for cache in caches[:2]] == [7, 5] and caches[2].spec.num_slots == 4
    assert caches[0].spec.scales == ((0.5, 1.0), (3.5, 1.0)) and caches[1].spec.scales == ((1.5, 1.0),)
    assert caches[2].spec.num_layers == 2 and [scratch_page(cache) for cache in caches] == [6, 4, 3]
    manager = CacheManager.for_groups(groups, (6, 4, 3), 8, prefix_caching=True)
    assert [(group.pool.num_blocks, group.pool.block_size) for group in manager.groups] == [(6, 8), (4, 8), (3, 1)]
    assert not manager.caches_prefixes  # a recurrent group serves no hit
    with pytest.raises(ValueError, match="2 page counts for 3 cache groups"):
        allocate_caches(MockGpuBackend(), groups, (6, 4), 8, DType.F32)
