"""The Gemma 3 text loader (`Gemma3ForCausalLM`: Gemma 3 1B, and the text part of the larger
ones when saved as a causal LM).

Layers interleave sliding-window and full attention (`layer_types`, or every sixth layer full),
each type with its own RoPE (a local base frequency for the sliding layers; the global one,
possibly scaled, for the full layers). Each layer is sandwich-normed: a norm before and after
attention and before and after its GeGLU (GELU-tanh); q and k are RMS-normed per head. Every
norm weight is stored as w for a multiplier 1 + w. The embedding is scaled by sqrt(hidden); the
softmax scale is `query_pre_attn_scalar` ** -0.5; the final logits are soft-capped where
config.json sets `final_logit_softcapping` (attention scores never are: transformers' Gemma 3
ignores `attn_logit_softcapping`, so a config that sets it is refused).
"""

from __future__ import annotations

from functools import partial

from atlas.domain.models import decoder
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, ModelConfigError
from atlas.domain.models.layers import Layer
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import read_quantization
from atlas.ports.gpu import GpuBackend, Kind
from atlas.ports.weights import WeightSource

ARCHITECTURES = ("Gemma3ForCausalLM",)
QUERY_PRE_ATTN_SCALAR = 256  # transformers' default where config.json names none


def kinds(config: ModelConfig) -> frozenset[Kind]:
    return frozenset({Kind.DENSE, Kind.ATTENTION})


def load_gemma3(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: decoder.ProgressCallback | None = None,
) -> Model:
    """Build a `Model` from a Gemma 3 text checkpoint; raises WeightError naming a bad tensor and
    ModelConfigError naming an option Atlas does not run."""
    if config.raw.get("use_bidirectional_attention"):
        raise ModelConfigError(
            "use_bidirectional_attention: Gemma 3's bidirectional (encoder) attention is not supported; "
            "Atlas runs causal decoders"
        )
    if config.attn_logit_softcap is not None:
        raise ModelConfigError(
            "attn_logit_softcapping: Gemma 3 normalises q and k instead of soft-capping attention scores, and "
            "transformers ignores this field; Atlas refuses a config that sets it rather than guess (use null)"
        )
    decoder.check_layer_types(config, (FULL_ATTENTION, SLIDING_ATTENTION))
    gated = decoder.activation(config)
    reader = CheckpointReader(weights, read_quantization(config.raw))
    norm = decoder.offset_norms(reader, config.rms_norm_eps)
    groups = decoder.kv_groups(config)
    tables = decoder.rope_tables(config, backend, max_positions)
    scale = (config.query_pre_attn_scalar or QUERY_PRE_ATTN_SCALAR) ** -0.5
    options = decoder.AttentionOptions(norm, scale, qk_norm=True, post_norm="post_attention_layernorm")
    hidden = config.hidden_size

    def layer(index: int) -> Layer:
        prefix = f"model.layers.{index}"
        mixer = decoder.attention_mixer(config, reader, backend, index, groups, tables[index], options)
        feed_forward = decoder.glu_feed_forward(
            reader, backend, f"{prefix}.mlp", (hidden, config.intermediate_size),
            input_norm=norm(f"{prefix}.pre_feedforward_layernorm.weight", hidden), gated=gated,
            output_norm=norm(f"{prefix}.post_feedforward_layernorm.weight", hidden),
        )  # fmt: skip
        return Layer(mixer, feed_forward)

    vocab = partial(
        decoder.vocabulary, config, reader, backend, norm,
        embedding_scale=hidden**0.5, logit_softcap=config.final_logit_softcap,
    )  # fmt: skip
    return decoder.assemble(config, backend, groups, layer, vocab, progress)

