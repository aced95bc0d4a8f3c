"""Random-weight Hugging Face models of real families, shared by our engine and the reference.

Weights are rounded to bf16 once, so transformers (in float32) and Atlas read identical values.
Needs torch + transformers (the `oracle` extra); import this module only after importorskip.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# transformers before 5.19 (the GPU machine's 5.17) ignores GPT-OSS's swiglu_alpha and limit
from atlas.app.doctor import match_gpt_oss_experts

# the loader's row orders of Qwen3-Next's in_proj_qkvz and in_proj_ba, for the tests that map
# transformers' weights by hand
from atlas.domain.models.qwen3_next import ba_rows, qkvz_rows  # noqa: F401

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
    # Llama's optional biases: q/k/v and o_proj (attention_bias), gate/up/down (mlp_bias)
    "llama_bias": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0, attention_bias=True, mlp_bias=True,
    ),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    # Qwen3 with its window on: layer 0 full, the layers from max_window_layers on sliding; biases
    "qwen3_window": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_theta=1000000.0,
        use_sliding_window=True, sliding_window=16, max_window_layers=1, attention_bias=True,
    ),
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
    # DeltaNet, gated attention, DeltaNet, gated attention; MoE (8 experts, top 2, a gated shared
    # expert) but a dense GLU in layer 2; the first quarter of each attention head rotates
    "qwen3_next": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2], rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    # Qwen3.5: Qwen3-Next's layers with the DeltaNet projections split (in_proj_qkv, _z, _b, _a)
    # over a dense GLU; Qwen3.5-MoE the same over MoE (a gated shared expert) in every layer
    "qwen3_5": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
    "qwen3_5_moe": dict(
        architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=64,
        intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    config = dict(BASE)
    config.update(FAMILIES[family])
    config.update(overrides)
    return config


def build_reference(config_dict: dict[str, Any], seed: int = 0, device: str = "cpu"):
    """(transformers model in float32, {name: bf16 numpy array}) with identical weights. `device`
    "cuda" draws a GPU test's billions of parameters on the GPU (seconds, not minutes on the
    CPU; other values, as the generator differs) and leaves the model there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    with torch.device(device):
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
            tensors[name] = rounded.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # the same bits
    if config_dict.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    match_gpt_oss_experts(model, config_dict.get("swiglu_alpha", 1.702), config_dict.get("swiglu_limit", 7.0))
    return model, tensors


def reference_logits(model, token_ids: list[int]) -> np.ndarray:
    """Float32 logits [len, V] of every position."""
    import torch

    with torch.no_grad():
        output = model(torch.tensor([token_ids]))
    return output.logits[0].float().numpy()


def write_model_folder(folder, family: str, seed: int = 0, **overrides: Any):
    """A model folder as the hub has them: a random `family` model (bf16-exact weights) saved by
    transformers (config.json, model.safetensors), with a byte-level BPE tokenizer trained on a
    fixed text and a ChatML template. Returns the transformers model (float32) it holds."""
    import json
    from pathlib import Path

    from atlas.app.bench.tiny_model import CHAT_TEMPLATE, train_tokenizer

    folder = Path(folder)
    tokenizer = train_tokenizer(400)
    config = tiny_config(family, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), **overrides)
    model, _ = build_reference(config, seed)
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))  # fmt: skip
    return model


def teacher_forced_gap(model, prompt: list[int], token_ids: list[int], logprobs) -> float:
    """The largest |Atlas's logprob - transformers'| over the generated tokens, transformers
    (float32) reading the prompt and the tokens Atlas chose (teacher forcing)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(token_ids)])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1).numpy()
    start = len(prompt) - 1
    return max(abs(float(reference[start + j, token]) - got.logprob) for j, (token, got) in enumerate(zip(token_ids, logprobs, strict=True)))
