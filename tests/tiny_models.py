"""Random-weight Hugging Face models of real families, shared by our engine and the reference.

Weights are rounded to bf16 once, so transformers (in float32) and Atlas read identical values.
Needs torch + transformers (the `oracle` extra); import this module only after importorskip.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BASE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=100000.0, tie_word_embeddings=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0, sliding_window=24),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    "yarn": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=10000.0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    ),
    "linear": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    # The families below run transformers' eager attention: its SDPA path has no soft-capping.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32, rope_theta=1000000.0,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
        attn_implementation="eager",
    ),
    # Two sliding layers around a full one, each type with its RoPE (the full one scaled); caps
    # small enough to bend these activations.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=1.5, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, attn_implementation="eager",
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # YaRN from a short original context with untruncated ramp ends; a clamp the experts reach.
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=32, intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.0, attn_implementation="eager",
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=16.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64),
    ),
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    config = dict(BASE)
    config.update(FAMILIES[family])
    config.update(overrides)
    return config


def build_reference(config_dict: dict[str, Any], seed: int = 0):
    """(transformers model in float32, {name: bf16 numpy array}) with identical weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            # norms initialise to ones (Gemma's to zeros) and biases to zeros: perturb them so a
            # wrong norm weight or a dropped bias would show
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            rounded = param.to(torch.bfloat16)
            param.copy_(rounded.to(torch.float32))
            tensors[name] = rounded.to(torch.float32).numpy().astype(ml_dtypes.bfloat16)
    if config_dict.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return model, tensors


def reference_logits(model, token_ids: list[int]) -> np.ndarray:
    """Float32 logits [len, V] of every position."""
    import torch

    with torch.no_grad():
        output = model(torch.tensor([token_ids]))
    return output.logits[0].float().numpy()


def qkvz_rows(layer) -> np.ndarray:
    """Rows of transformers' Qwen3-Next in_proj_qkvz (per key head: q, k, its value heads' v,
    then z) in `DeltaNetLayer`'s order (all q, all k, all v, all z)."""
    dk, group_v = layer.key_head_dim, layer.num_value_heads // layer.num_key_heads * layer.value_head_dim
    per_head = 2 * dk + 2 * group_v
    starts = np.arange(layer.num_key_heads) * per_head
    parts = [(0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + group_v), (2 * dk + group_v, per_head)]
    return np.concatenate([np.arange(start + lo, start + hi) for lo, hi in parts for start in starts])


def ba_rows(layer) -> np.ndarray:
    """Rows of transformers' in_proj_ba (per key head: its value heads' b, then a) as all b, all a."""
    group = layer.num_value_heads // layer.num_key_heads
    starts = np.arange(layer.num_key_heads) * 2 * group
    return np.concatenate([np.arange(start + lo, start + lo + group) for lo in (0, group) for start in starts])
