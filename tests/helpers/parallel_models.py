"""Models for the tensor-parallel tests: a hybrid built from the layer kinds (as a family loader
would), the tiny Llama from its checkpoint, and a driver that runs a prompt and decodes through
`Model.forward` on one device or on every rank of a mock group.

The hybrid has a layer of every kind and every weight feature that shards differently: q/k/v
biases, q/k norms, attention sinks, a gated attention output, MoE experts with biases and a
gated shared expert, Gated DeltaNet, a dense GLU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from atlas.domain.models.cache_groups import KvShape, StateShape, group_caches, locate
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.families import load_model
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer
from atlas.domain.models.model import Model, StepTensors
from atlas.domain.models.parallel_model import load_rank_model, shard_model
from atlas.domain.models.deferred_load import DescribingBackend
from atlas.domain.parallel import RankPlacement
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HeadLayout, HostAttention, KvCacheSpec
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec
from fakes import DictWeights

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # 64 positions: block i holds positions 4i..4i+3, so a slot is a position


@dataclass(frozen=True, slots=True)
class HybridShape:
    vocab_size: int = 96
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    key_heads: int = 4  # Gated DeltaNet
    value_heads: int = 8
    linear_head_dim: int = 8
    experts: int = 8
    top_k: int = 2
    expert_width: int = 32
    shared_width: int = 48
    intermediate: int = 96


def hybrid_model(backend, shape: HybridShape = HybridShape(), seed: int = 0) -> Model:
    """Layers: attention (biases, q/k norms, sinks) x MoE (biases, gated shared expert);
    Gated DeltaNet x dense GLU; gated attention x MoE. Prepared on `backend` (a describing one
    for a rank's load)."""
    rng = np.random.default_rng(seed)

    def weights(*dims: int, scale: float = 0.15) -> np.ndarray:
        return (scale * rng.standard_normal(dims)).astype(np.float32)

    def norm(width: int) -> RmsNorm:
        return RmsNorm(1.0 + 0.1 * rng.standard_normal(width).astype(np.float32), 1e-6)

    hidden = shape.hidden
    heads = HeadLayout(shape.heads, shape.kv_heads, shape.head_dim)
    delta = DeltaNetLayer(0, shape.key_heads, shape.value_heads, shape.linear_head_dim, shape.linear_head_dim, 4)
    kv, state = KvShape(shape.kv_heads, shape.head_dim), StateShape(delta.conv_dim, 4, shape.value_heads,
                                                                    shape.linear_head_dim, shape.linear_head_dim)
    groups = group_caches([kv, state, kv])
    angles = np.arange(64)[:, None] * 10000.0 ** (-np.arange(0, shape.head_dim, 2) / shape.head_dim)[None, :]
    table = backend.upload(np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32), DType.F32)
    dense = backend.dense

    def attention(index: int, gated: bool) -> AttentionMixer:
        group, position = locate(groups, index)
        spec = AttentionLayer(heads, position, shape.head_dim**-0.5, table, gated_output=gated)
        rows = spec.q_width + 2 * heads.kv_size
        host = HostAttention(norm(hidden), HostLinear(weights(rows, hidden), weights(rows, scale=0.05)),
                             norm(shape.head_dim), norm(shape.head_dim),
                             None if gated else weights(shape.heads, scale=1.0))
        output = HostProjection(HostLinear(weights(hidden, heads.q_size), weights(hidden, scale=0.05)))
        return AttentionMixer(spec, group, backend.attention.prepare(host, spec), dense.prepare(output), hidden)

    def moe(shared: bool) -> MoeFeedForward:
        routing = Routing(shape.experts, shape.top_k, Scoring.SOFTMAX, renormalize=True)
        width, experts = shape.expert_width, shape.experts
        shared_expert = HostSharedExpert(HostLinear(weights(2 * shape.shared_width, hidden)),
                                         HostLinear(weights(hidden, shape.shared_width), weights(hidden, scale=0.05)),
                                         HostLinear(weights(1, hidden))) if shared else None
        host = HostMoe(norm(hidden), HostLinear(weights(experts, hidden, scale=0.5)),
                       HostLinear(weights(experts, 2 * width, hidden), weights(experts, 2 * width, scale=0.05)),
                       HostLinear(weights(experts, hidden, width), weights(experts, hidden, scale=0.05)),
                       Activation.SILU, routing, shared=shared_expert)
        return MoeFeedForward(backend.moe.prepare(host), shape.top_k, hidden,
                              max(width, shape.shared_width if shared else 0))

    group, position = locate(groups, 1)
    spec = replace(delta, state_layer=position)
    delta_host = HostDeltaNet(weights(spec.conv_dim, 4, scale=0.3), np.log(rng.uniform(1, 16, shape.value_heads)),
                              weights(shape.value_heads, scale=0.5), norm(spec.value_head_dim))
    delta_net = DeltaNetMixer(
        spec, group, dense.prepare(HostProjection(HostLinear(weights(spec.projected_width, hidden)), norm(hidden))),
        backend.recurrent.prepare(delta_host, spec),
        dense.prepare(HostProjection(HostLinear(weights(hidden, spec.value_dim)))),
        hidden,
    )
    glu = DenseFeedForward(
        dense.prepare(HostProjection(HostLinear(weights(2 * shape.intermediate, hidden)), norm(hidden),
                                     Activation.SILU)),
        dense.prepare(HostProjection(HostLinear(weights(hidden, shape.intermediate)))), shape.intermediate, hidden,
    )
    layers = [Layer(attention(0, False), moe(True)), Layer(delta_net, glu), Layer(attention(2, True), moe(False))]
    vocab = dense.prepare_vocab(HostVocab(weights(shape.vocab_size, hidden, scale=1.0), norm(hidden),
                                          HostLinear(weights(shape.vocab_size, hidden, scale=0.5))))
    return Model(backend, vocab, layers, groups, hidden, shape.vocab_size)


def hybrid_rank_model(backend, comm, placement: RankPlacement, shape: HybridShape = HybridShape(),
                      seed: int = 0) -> Model:
    described = hybrid_model(DescribingBackend(backend), shape, seed)
    return shard_model(described, backend, comm, placement, max_tokens=32, max_rows=32)


def llama_model(backend, config: dict, tensors: dict, comm=None, placement: RankPlacement | None = None) -> Model:
    model_config = ModelConfig.from_dict(config)
    if placement is None:
        return load_model(model_config, DictWeights(tensors), backend, 64)
    return load_rank_model(model_config, DictWeights(tensors), backend, comm, placement, 64, max_tokens=32, max_rows=32)


def run_prompt_and_decodes(backend, model: Model, tokens: list[int], prompt_len: int) -> np.ndarray:
    """Logits [len(tokens) - prompt_len + 1... ] of the prompt's last position and of each decode
    step after it, one sequence in pages 0, 1, 2, ... and state slot 1."""
    caches = [_allocate(backend, group.shape, len(group.layers)) for group in model.cache_groups]
    workspace = model.allocate_workspace(32, 32)
    rows = [backend.download(model.forward(_step(backend, model, tokens[:prompt_len], 0, sample_last=True), caches,
                                           workspace, 1))]
    for position in range(prompt_len, len(tokens)):
        step = _step(backend, model, tokens[position:position + 1], position)
        rows.append(backend.download(model.forward(step, caches, workspace, 1)))
    return np.concatenate(rows)


def run_batch(backend, model: Model, tokens: list[int]) -> np.ndarray:
    """Logits of every position of one prompt (several sampled rows at once)."""
    caches = [_allocate(backend, group.shape, len(group.layers)) for group in model.cache_groups]
    workspace = model.allocate_workspace(32, 32)
    return backend.download(model.forward(_step(backend, model, tokens, 0), caches, workspace, len(tokens)))


def _allocate(backend, shape, num_layers: int):
    if isinstance(shape, KvShape):
        return backend.attention.allocate_cache(
            KvCacheSpec(num_layers, NUM_BLOCKS, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, DType.F32))
    return backend.recurrent.allocate_state(RecurrentStateSpec(
        num_layers, 2, shape.conv_dim, shape.conv_kernel, shape.num_heads, shape.key_dim, shape.value_dim))


def _step(backend, model: Model, tokens: list[int], start: int, sample_last: bool = False) -> StepTensors:
    count, context = len(tokens), start + len(tokens)
    positions = np.arange(start, context, dtype=np.int32)
    tables = np.arange(NUM_BLOCKS, dtype=np.int32)[None, :]
    query_start, seq_lens = np.array([0, count], np.int32), np.array([context], np.int32)
    meta = AttentionMetadata(
        backend.upload(positions), backend.upload(positions), backend.upload(query_start), backend.upload(seq_lens),
        backend.upload(tables), count, 1, count, context,
    )
    recurrent = RecurrentMetadata(backend.upload(query_start), backend.upload(seq_lens),
                                  backend.upload(np.array([1], np.int32)), count, 1, count)
    sample = backend.upload(np.array([count - 1], np.int32)) if sample_last else None
    metadata = tuple(meta if group.kind.is_kv else recurrent for group in model.cache_groups)
    return StepTensors(backend.upload(np.asarray(tokens, np.int32)), metadata, sample)
