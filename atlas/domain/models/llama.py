"""The Llama family loader: Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5 and Qwen3.

Every layer is an attention mixer times a dense GLU; the differences are data: q/k/v biases
(Qwen2; o_proj's too where Llama's or Qwen3's attention_bias says, the GLU's where mlp_bias
says), per-head q/k RMSNorm (Qwen3), a sliding window (Mistral v0.1; Qwen2 and Qwen3 from layer
max_window_layers on), tied embeddings (small models), RoPE scaling (Llama 3.1). This module
maps Hugging Face tensor names onto those layer kinds, fusing q/k/v and gate/up into single
projections; the backend prepares each.
"""

from __future__ import annotations

from functools import partial

from atlas.domain.models import decoder
from atlas.domain.models.cache_groups import CacheGroupSpec, locate
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from atlas.domain.models.feed_forward import DenseFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.mixers import AttentionMixer
from atlas.domain.models.quantization_config import read_quantization
from atlas.domain.models.model import Model
from atlas.domain.models.rope import rope_table
from atlas.ports.gpu import DType, GpuBackend, Kind, Tensor
from atlas.ports.kernels.attention import AttentionLayer, HeadLayout, HostAttention
from atlas.ports.kernels.dense import HostProjection
from atlas.ports.kernels.host_weights import Activation
from atlas.ports.weights import WeightSource

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def kinds(config: ModelConfig) -> frozenset[Kind]:
    """The kernel kinds a model of this family calls."""
    return frozenset({Kind.DENSE, Kind.ATTENTION})


def load_llama_family(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: decoder.ProgressCallback | None = None,
) -> Model:
    """Build a `Model` from a Llama-family checkpoint (float, or FP8 projections as
    config.json's quantization_config describes them); raises WeightError naming a bad tensor."""
    activation = decoder.activation(config)
    reader = CheckpointReader(weights, read_quantization(config.raw))
    decoder.check_layer_types(config, (FULL_ATTENTION, SLIDING_ATTENTION))
    groups = decoder.kv_groups(config)
    table = backend.upload(rope_table(config, max_positions), DType.F32)
    layer = partial(_layer, config, reader, backend, activation=activation, table=table, groups=groups)
    vocab = partial(decoder.vocabulary, config, reader, backend, decoder.plain_norms(reader, config.rms_norm_eps))
    return decoder.assemble(config, backend, groups, layer, vocab, progress)


def _layer(
    config: ModelConfig,
    reader: CheckpointReader,
    backend: GpuBackend,
    index: int,
    activation: Activation,
    table: Tensor,
    groups: tuple[CacheGroupSpec, ...],
) -> Layer:
    prefix = f"model.layers.{index}"
    hidden, head_dim, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
    heads = HeadLayout(config.num_heads, config.num_kv_heads, head_dim)
    projections = [
        (f"{prefix}.self_attn.q_proj", heads.q_size),
        (f"{prefix}.self_attn.k_proj", heads.kv_size),
        (f"{prefix}.self_attn.v_proj", heads.kv_size),
    ]
    qkv = reader.stacked_linear(projections, hidden, bias=config.attention_bias)
    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = reader.norm(f"{prefix}.self_attn.q_norm.weight", head_dim, eps)
        k_norm = reader.norm(f"{prefix}.self_attn.k_norm.weight", head_dim, eps)
    group, cache_layer = locate(groups, index)
    window = config.layer_window(index)
    spec = AttentionLayer(heads, cache_layer, scale=head_dim**-0.5, rope_table=table, sliding_window=window)
    host = HostAttention(reader.norm(f"{prefix}.input_layernorm.weight", hidden, eps), qkv, q_norm, k_norm)
    dense = backend.dense
    # transformers' Qwen2 biases q/k/v only; Llama and Qwen3 bias o_proj too where attention_bias says
    output_bias = config.attention_bias and config.model_type != "qwen2"
    output = reader.linear(f"{prefix}.self_attn.o_proj", hidden, heads.q_size, output_bias)
    mixer = AttentionMixer(
        spec=spec,
        group=group,
        attention=backend.attention.prepare(host, spec),
        output=dense.prepare(HostProjection(output)),
        hidden_size=hidden,
    )
    intermediate, mlp_bias = config.intermediate_size, config.mlp_bias
    gate_up = reader.stacked_linear(
        [(f"{prefix}.mlp.gate_proj", intermediate), (f"{prefix}.mlp.up_proj", intermediate)], hidden, mlp_bias
    )
    feed_forward = DenseFeedForward(
        gate_up=dense.prepare(
            HostProjection(
                gate_up,
                input_norm=reader.norm(f"{prefix}.post_attention_layernorm.weight", hidden, eps),
                activation=activation,
            )
        ),
        down=dense.prepare(HostProjection(reader.linear(f"{prefix}.mlp.down_proj", hidden, intermediate, mlp_bias))),
        intermediate_size=intermediate,
        hidden_size=hidden,
    )
    return Layer(mixer, feed_forward)
