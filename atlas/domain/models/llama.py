"""The Llama family loader: Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5 and Qwen3.

They share one layer shape (RMSNorm, RoPE, GQA attention, SwiGLU MLP); the differences are
data: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), a sliding window (Mistral v0.1),
tied embeddings (small models), RoPE scaling (Llama 3.1). This module maps Hugging Face tensor
names onto the generic `DecoderLayer`, fusing q/k/v and gate/up into single projections.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.rope import rope_table
from atlas.domain.models.transformer import (
    AttentionWeights,
    DecoderLayer,
    MlpWeights,
    Transformer,
    fold_norm_weights,
)
from atlas.ports.gpu import Activation, DType, GpuBackend, Tensor
from atlas.ports.weights import WeightError, WeightSource

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}

ProgressCallback = Callable[[int, int], None]


class _Uploader:
    """Reads tensors by name, checks their shapes, converts to the weight dtype and uploads."""

    def __init__(self, weights: WeightSource, backend: GpuBackend, dtype: DType) -> None:
        self.weights = weights
        self.backend = backend
        self.dtype = dtype

    def host(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weights:
            raise WeightError(
                f"the checkpoint has no tensor {name!r}: the model folder is incomplete or does not match config.json"
            )
        array = self.weights.get(name)
        if tuple(array.shape) != shape:
            raise WeightError(f"tensor {name!r} has shape {tuple(array.shape)}, config.json implies {shape}")
        return array

    def tensor(self, name: str, shape: tuple[int, ...]) -> Tensor:
        return self.backend.upload(self.host(name, shape), self.dtype)

    def stacked(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Tensor:
        return self.backend.upload(np.concatenate([self.host(n, s) for n, s in names_and_shapes], axis=0), self.dtype)

    def optional(self, name: str, shape: tuple[int, ...]) -> Tensor | None:
        return self.tensor(name, shape) if name in self.weights else None


def load_llama_family(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: ProgressCallback | None = None,
) -> Transformer:
    """Build a `Transformer` from a Llama-family checkpoint; raises WeightError naming a bad tensor."""
    activation = ACTIVATIONS.get(config.hidden_act)
    if activation is None:
        raise ModelConfigError(f"hidden_act {config.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    upload = _Uploader(weights, backend, DType.BF16)
    hidden = config.hidden_size
    total_steps = config.num_layers + 2

    embedding = upload.tensor("model.embed_tokens.weight", (config.vocab_size, hidden))
    layers = []
    for index in range(config.num_layers):
        layers.append(_layer(config, upload, index, activation))
        if progress:
            progress(index + 1, total_steps)

    final_norm = upload.tensor("model.norm.weight", (hidden,))
    if config.tie_word_embeddings:
        lm_head = embedding
    elif "lm_head.weight" in weights:
        lm_head = upload.tensor("lm_head.weight", (config.vocab_size, hidden))
    else:
        raise WeightError("the checkpoint has no lm_head.weight and config.json does not tie word embeddings")
    table = backend.upload(rope_table(config, max_positions), DType.F32)
    layers, folded_final_norm = fold_norm_weights(backend, layers, final_norm, lm_head, embedding)
    if progress:
        progress(total_steps, total_steps)
    return Transformer(config, backend, embedding, layers, folded_final_norm, lm_head, table)


def _layer(config: ModelConfig, upload: _Uploader, index: int, activation: Activation) -> DecoderLayer:
    prefix = f"model.layers.{index}"
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    projections = [
        (f"{prefix}.self_attn.q_proj", q_size),
        (f"{prefix}.self_attn.k_proj", kv_size),
        (f"{prefix}.self_attn.v_proj", kv_size),
    ]
    qkv = upload.stacked([(f"{name}.weight", (rows, hidden)) for name, rows in projections])
    qkv_bias = None
    if config.attention_bias:
        qkv_bias = upload.stacked([(f"{name}.bias", (rows,)) for name, rows in projections])
    q_norm = k_norm = None
    if config.qk_norm:
        q_norm = upload.tensor(f"{prefix}.self_attn.q_norm.weight", (head_dim,))
        k_norm = upload.tensor(f"{prefix}.self_attn.k_norm.weight", (head_dim,))
    attention = AttentionWeights(
        qkv=qkv,
        qkv_bias=qkv_bias,
        output=upload.tensor(f"{prefix}.self_attn.o_proj.weight", (hidden, q_size)),
        q_norm=q_norm,
        k_norm=k_norm,
    )
    intermediate = config.intermediate_size
    mlp = MlpWeights(
        gate_up=upload.stacked(
            [
                (f"{prefix}.mlp.gate_proj.weight", (intermediate, hidden)),
                (f"{prefix}.mlp.up_proj.weight", (intermediate, hidden)),
            ]
        ),
        down=upload.tensor(f"{prefix}.mlp.down_proj.weight", (hidden, intermediate)),
        activation=activation,
    )
    return DecoderLayer(
        input_norm=upload.tensor(f"{prefix}.input_layernorm.weight", (hidden,)),
        attention=attention,
        post_attention_norm=upload.tensor(f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        mlp=mlp,
        sliding_window=config.sliding_window,
    )
