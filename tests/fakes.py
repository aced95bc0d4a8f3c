"""Fakes implementing the ports, for tests that need no files."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


class DictWeights:
    """A `WeightSource` over an in-memory {name: array} mapping."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self._tensors = dict(tensors)

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        return self._tensors[name]


TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def random_llama_weights(config: Mapping, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random bf16 weights with Hugging Face names for a Llama-shaped `config` (no torch needed)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = scale * rng.standard_normal(shape)
        tensors[name] = values.astype(np.float32).astype(ml_dtypes.bfloat16)
    return tensors
