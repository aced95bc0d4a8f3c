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
