"""The pieces the attention-decoder loaders share (Qwen3-MoE, Gemma 3, GPT-OSS; Llama and
Qwen3-Next take some): RoPE tables per layer type, the KV cache groups, an attention mixer from a
layer's q/k/v/o tensors, a dense GLU, the vocabulary, and the model assembled from its layers
with loading progress. Projections come as stored, float or FP8 with their scales, where the
loader's `CheckpointReader` has the checkpoint's quantization.

What a family decides is data passed in: how its checkpoint stores norm weights (`NormReader`),
its attention's softmax scale, q/k norms, sinks and post-norm (`AttentionOptions`). Tensors are
read and shape-checked through `CheckpointReader`, so a missing or misshapen tensor is a
`WeightError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, group_caches, locate
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import SLIDING_ATTENTION, ModelConfig, ModelConfigError, Rope
from atlas.domain.models.feed_forward import DenseFeedForward
from atlas.domain.models.layers import Layer
from atlas.domain.models.mixers import AttentionMixer
from atlas.domain.models.model import Model
from atlas.domain.models.rope import rope_table
from atlas.ports.gpu import DType, GpuBackend, Tensor
from atlas.ports.kernels.attention import AttentionLayer, HeadLayout, HostAttention
from atlas.ports.kernels.dense import HostProjection, HostVocab, Vocab
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.kernels.moe import Routing, Scoring
from atlas.ports.weights import WeightError

ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}

ProgressCallback = Callable[[int, int], None]
NormReader = Callable[[str, int], RmsNorm]
"""(tensor name, width) -> the RMSNorm that tensor stands for."""


def plain_norms(reader: CheckpointReader, eps: float) -> NormReader:
    """Norm weights stored as the multiplier itself (Llama, Qwen, GPT-OSS)."""
    return lambda name, width: reader.norm(name, width, eps)


def offset_norms(reader: CheckpointReader, eps: float) -> NormReader:
    """Norm weights stored as w for a multiplier 1 + w (Gemma), added in float32 as
    transformers does."""
    return lambda name, width: RmsNorm(1.0 + reader.array(name, (width,)).astype(np.float32), eps)


def activation(config: ModelConfig) -> Activation:
    """The dense GLU's activation named by config.json; `ModelConfigError` for any other."""
    found = ACTIVATIONS.get(config.hidden_act)
    if found is None:
        supported = ", ".join(ACTIVATIONS)
        raise ModelConfigError(f"hidden_act {config.hidden_act!r} is not supported; supported: {supported}")
    return found


def check_layer_types(config: ModelConfig, supported: tuple[str, ...]) -> None:
    """Refuse a `layer_types` entry the family's loader does not build, and sliding layers
    without a `sliding_window`, naming the field."""
    unknown = sorted(set(config.layer_types) - set(supported))
    if unknown:
        raise ModelConfigError(
            f"layer_types: {', '.join(unknown)} layers are not supported for {config.architecture}; "
            f"supported: {', '.join(supported)}"
        )
    if SLIDING_ATTENTION in config.layer_types and config.sliding_window is None:
        raise ModelConfigError("sliding_window: config.json has sliding_attention layers but no window for them")


def routing(config: ModelConfig, renormalize: bool) -> Routing:
    """Softmax routing to the config's top `num_experts_per_tok` of `num_experts` experts."""
    experts, top_k = config.num_experts, config.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok: {top_k} must be in [1, num_experts = {experts}]")
    return Routing(experts, top_k, Scoring.SOFTMAX, renormalize=renormalize)


def kv_groups(config: ModelConfig) -> tuple[CacheGroupSpec, ...]:
    """The KV cache groups, each layer declared with its own window: sliding layers form groups
    of their own, whose pages are released once they leave the window."""
    heads, dim = config.num_kv_heads, config.head_dim
    return group_caches([KvShape(heads, dim, config.layer_window(layer)) for layer in range(config.num_layers)])


def rope_tables(config: ModelConfig, backend: GpuBackend, max_positions: int) -> list[Tensor]:
    """Each layer's RoPE table on the device, one upload per distinct RoPE (layer type)."""
    uploaded: dict[Rope, Tensor] = {}
    tables = []
    for layer in range(config.num_layers):
        rope = config.layer_rope(layer)
        if rope not in uploaded:
            uploaded[rope] = backend.upload(rope_table(config, max_positions, rope), DType.F32)
        tables.append(uploaded[rope])
    return tables


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """How a family's attention layer reads, besides the shapes config.json gives.

    scale: the softmax scale. qk_norm: per-head q_norm / k_norm tensors. sinks: a `sinks`
    tensor [Hq]. post_norm: the name (under the layer) of a norm applied to o_proj's output
    before the residual add (Gemma's `post_attention_layernorm`). q/k/v and o_proj carry biases
    where config.json's `attention_bias` says.
    """

    norm: NormReader
    scale: float
    qk_norm: bool = False
    sinks: bool = False
    post_norm: str | None = None


def attention_mixer(
    config: ModelConfig,
    reader: CheckpointReader,
    backend: GpuBackend,
    index: int,
    groups: tuple[CacheGroupSpec, ...],
    table: Tensor,
    options: AttentionOptions,
) -> AttentionMixer:
    """Layer `index`'s self-attention (`model.layers.N.self_attn.*` after `input_layernorm`)."""
    prefix = f"model.layers.{index}"
    attn = f"{prefix}.self_attn"
    hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
    heads = HeadLayout(config.num_heads, config.num_kv_heads, head_dim)
    rows = [("q_proj", heads.q_size), ("k_proj", heads.kv_size), ("v_proj", heads.kv_size)]
    qkv = reader.stacked_linear([(f"{attn}.{name}", size) for name, size in rows], hidden)  # float or FP8
    if bias:
        qkv = replace(qkv, bias=reader.stacked([(f"{attn}.{name}.bias", (size,)) for name, size in rows]))
    q_norm = options.norm(f"{attn}.q_norm.weight", head_dim) if options.qk_norm else None
    k_norm = options.norm(f"{attn}.k_norm.weight", head_dim) if options.qk_norm else None
    sinks = reader.array(f"{attn}.sinks", (heads.num_q_heads,)).astype(np.float32) if options.sinks else None
    group, cache_layer = locate(groups, index)
    spec = AttentionLayer(heads, cache_layer, options.scale, table, sliding_window=config.layer_window(index))
    host = HostAttention(options.norm(f"{prefix}.input_layernorm.weight", hidden), qkv, q_norm, k_norm, sinks)
    post_norm = options.norm(f"{prefix}.{options.post_norm}.weight", hidden) if options.post_norm else None
    output = HostProjection(reader.linear(f"{attn}.o_proj", hidden, heads.q_size, bias), output_norm=post_norm)
    return AttentionMixer(spec, group, backend.attention.prepare(host, spec), backend.dense.prepare(output), hidden)


def glu_feed_forward(
    reader: CheckpointReader,
    backend: GpuBackend,
    prefix: str,
    sizes: tuple[int, int],
    input_norm: RmsNorm,
    gated: Activation,
    output_norm: RmsNorm | None = None,
) -> DenseFeedForward:
    """A dense GLU from `<prefix>.gate_proj`, `.up_proj` and `.down_proj`; `sizes`: (hidden,
    intermediate). `output_norm`: Gemma's post-feed-forward norm."""
    hidden, intermediate = sizes
    parts = [(f"{prefix}.gate_proj", intermediate), (f"{prefix}.up_proj", intermediate)]
    gate_up = reader.stacked_linear(parts, hidden)  # float or FP8
    dense = backend.dense
    return DenseFeedForward(
        gate_up=dense.prepare(HostProjection(gate_up, input_norm=input_norm, activation=gated)),
        down=dense.prepare(
            HostProjection(reader.linear(f"{prefix}.down_proj", hidden, intermediate), output_norm=output_norm)
        ),
        intermediate_size=intermediate,
        hidden_size=hidden,
    )


def assemble(
    config: ModelConfig,
    backend: GpuBackend,
    groups: tuple[CacheGroupSpec, ...],
    layer: Callable[[int], Layer],
    vocab: Callable[[], Vocab],
    progress: ProgressCallback | None,
) -> Model:
    """The model from its layers, built in order by `layer(index)`, then its vocabulary: one
    loading step each, reported as `progress(done, total)` after it."""
    total = config.num_layers + 1
    layers = []
    for index in range(config.num_layers):
        layers.append(layer(index))
        if progress:
            progress(index + 1, total)
    built = vocab()
    if progress:
        progress(total, total)
    return Model(backend, built, layers, groups, config.hidden_size, config.vocab_size)


def vocabulary(
    config: ModelConfig,
    reader: CheckpointReader,
    backend: GpuBackend,
    norm: NormReader,
    embedding_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> Vocab:
    """`model.embed_tokens`, `model.norm` and `lm_head` (the embedding where tied)."""
    hidden = config.hidden_size
    lm_head: HostLinear | None = None
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in reader:
            raise WeightError("the checkpoint has no lm_head.weight and config.json does not tie word embeddings")
        lm_head = reader.linear("lm_head", config.vocab_size, hidden)
    return backend.dense.prepare_vocab(
        HostVocab(
            embedding=reader.array("model.embed_tokens.weight", (config.vocab_size, hidden)),
            final_norm=norm("model.norm.weight", hidden),
            lm_head=lm_head,
            embedding_scale=embedding_scale,
            logit_softcap=logit_softcap,
        )
    )
